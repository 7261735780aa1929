"""How training is split over ranks: the mesh and its groups (:mod:`.mesh`), tensor
parallelism's communication (:mod:`.regions` for the GPT, :mod:`.tensor` for the MLP's
layers), the flat buffers with their units and shards (:mod:`.flat`), the data-parallel
strategies (:mod:`.strategy`: single, DDP and the parameter server; :mod:`.zero`: ZeRO stages
1–3 and offload), and one step on one rank with its pipeline schedule (:mod:`.step`)."""
