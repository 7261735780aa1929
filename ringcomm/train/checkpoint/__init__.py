"""Checkpoints of the trainer: the on-disk format, and where each part lives.

- :mod:`.files`: durable files, verification against the manifest, finding and pruning.
- :mod:`.layout`: a rank's placement in the whole model; assembling whole parameters.
- :mod:`.state`: saving every rank's state, resuming (resharding where the layout changed).
- :mod:`.cli`: ``python -m ringcomm.checkpoint`` (``list``, ``consolidate``).

    python -m ringcomm.checkpoint list D                  # every checkpoint in D
    python -m ringcomm.checkpoint consolidate D out.npz   # newest complete one -> fp32 parameters by name
    python -m ringcomm.checkpoint consolidate D/step_000120 out.npz

Format
------
``D/step_000120/`` holds the state after 120 completed steps:

- ``rank{r}.npz``, one per rank (``np.savez``, plain arrays, loaded with
  ``allow_pickle=False``): ``master`` (fp32; what the rank's optimizer works on, see
  ``checkpoint_kind`` in :mod:`ringcomm.train.parallel.strategy`: the whole padded flat
  buffer for ``single``/``ddp``/``dp``, the rank's shard buffer for ZeRO), the optimizer
  state ``m``, ``v`` (Adam; same length as ``master``, empty on ``dp`` ranks other than 0)
  and ``t``, the loss scaler (``scaler_scale``, ``scaler_clean``, ``scaler_hysteresis``,
  ``scaler_skipped``), the data position ``step`` and ``seed`` (batches are a pure function of
  them, and nothing else draws random numbers after initialisation, so they are the whole
  RNG state), the losses so far, ``rank``, ``world_size`` and the rank's ``placement`` (a
  JSON record as bytes, see :mod:`.layout`: the mesh, the rank's
  coordinates in it, the pieces of parameters it holds and the flat layout of its data
  group).
- ``manifest.json``, written last by rank 0: strategy, world size, mesh, precision,
  optimizer, the model (MLP widths or GPT dimensions) and every parameter's name and shape,
  step, number of parameters, rank 0's flat layout (parameter offsets; every unit's start,
  length, padding and shard size) and each rank file's sha256 and size.

Every file is written to a temporary name, flushed, fsynced and renamed, and the directory
is fsynced. Rank 0 writes the manifest only after gathering every rank's digest, i.e. once
every rank file is durable; a final broadcast tells every rank the checkpoint is complete.
A directory without a manifest is an *unfinished* write; one whose files do not match its
manifest is *damaged*. ``--resume`` takes the newest complete and intact checkpoint, names
every newer one it skips and moves the damaged ones into ``D/damaged/``; with checkpoints
present but none intact it fails, listing them, and changes nothing (writes that never
finished, without a manifest, were never checkpoints: with only those it starts fresh). After a checkpoint is
complete, rank 0 keeps it and the one before it, deletes older ones and unfinished writes
(manifest first, so that a half-deleted directory is never mistaken for a complete one) and
moves damaged ones aside, never deleting them. A run without ``--resume`` refuses a
directory that holds checkpoints unless ``--overwrite`` is given.

Resuming with the placement it was saved with (every rank placed as it is now) loads each
rank's own file. Otherwise (another world size, strategy or mesh) the state is *resharded*:
the whole fp32 parameters and optimizer state are assembled by name from all rank files and
every rank cuts its pieces and packs them under its new layout. The directory must be visible to
every rank (one host, or a shared filesystem).
"""
