"""The trainer's configuration: one typed dataclass, the command line generated from it, and
every check of a combination in one place (:func:`validate`), run before any byte is sent.

Each field carries its help text; ``--flag`` names are the field names with dashes. A
boolean field that defaults to True becomes ``--no-<name>``. With ``--model gpt`` the
command line's defaults of ``--steps``, ``--batch-size`` and ``--lr`` are the GPT's
(:data:`GPT_DEFAULTS`).

>>> cfg = parse_args(["--model", "gpt", "--cp", "2", "--tp", "2"])
>>> cfg.model, cfg.cp, cfg.tp
('gpt', 2, 2)
"""
import argparse
import dataclasses
import sys
from dataclasses import dataclass, field, fields

from .accounting.memory import STRATEGIES

MODELS = ("mlp", "gpt")
# the GPT's own defaults, where the command line leaves these flags out
GPT_DEFAULTS = dict(steps=300, batch_size=64, lr=3e-3)
MAIN_JOB = dict(strategy="zero2", precision="fp16", steps=1000, batch_size=512, layers="64,512,512,512,10",
                lr=2e-3, samples=65536)


def _opt(default, help, **kw):
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass
class TrainConfig:
    # -- what is trained ------------------------------------------------------------------------
    model: str = _opt("mlp", "the model: an MLP on feature vectors, or a small GPT on text", choices=MODELS)
    layers: tuple = _opt((64, 256, 256, 10), "MLP layer widths, input first", parse="widths")
    n_layer: int = _opt(2, "GPT: transformer blocks")
    n_head: int = _opt(4, "GPT: attention heads")
    d_model: int = _opt(64, "GPT: width")
    seq_len: int = _opt(64, "GPT: positions per sequence")
    vocab: int = _opt(256, "GPT: vocabulary size (256: bytes)")
    # -- how it is trained ----------------------------------------------------------------------
    strategy: str = _opt("ddp", "data parallelism: single (one process), dp (parameter server), ddp, "
                         "zero1, zero2, zero3", choices=STRATEGIES)
    offload: bool = _opt(False, "optimizer state and step in host memory (ZeRO)")
    precision: str = _opt("fp32", "fp32, or fp16 mixed precision with dynamic loss scaling",
                          choices=("fp32", "fp16"))
    optimizer: str = _opt("adam", "Adam or SGD", choices=("adam", "sgd"))
    lr: float = _opt(1e-3, "learning rate")
    weight_decay: float = _opt(0.0, "L2 weight decay")
    clip_grad_norm: float = _opt(None, "clip by the global gradient norm")
    steps: int = _opt(100, "optimizer steps")
    batch_size: int = _opt(256, "the global batch (samples or sequences, all ranks together)")
    seed: int = _opt(0, "seed of the initialisation and the batch order")
    data: str = _opt(None, "an .npz: MLP x, y (optional x_test, y_test); GPT integer x, y of shape (n, T)")
    samples: int = _opt(8192, "size of the synthetic MLP training set")
    bucket_mb: float = _opt(25.0, "gradient bucket size in MiB (first bucket at most 1 MiB)")
    overlap: bool = _opt(True, "communicate gradients during backward (--no-overlap: after it)")
    # -- layout -----------------------------------------------------------------------------------
    dp: int = _opt(0, "data-parallel size (default: world / (cp·pp·tp))")
    cp: int = _opt(1, "context-parallel size (GPT: each rank holds 1/cp of every sequence)")
    pp: int = _opt(1, "pipeline stages")
    tp: int = _opt(1, "tensor-parallel size")
    sp: bool = _opt(False, "sequence parallelism inside the tp group (GPT, with --tp)")
    micro_batches: int = _opt(1, "micro-batches per step (pipeline)")
    schedule: str = _opt("1f1b", "pipeline schedule", choices=("gpipe", "1f1b"))
    recompute: bool = _opt(False, "keep only each layer's input; recompute the rest in backward")
    device: str = _opt(None, "each worker's device (default: RINGCOMM_DEVICE, else auto)",
                       choices=("auto", "cpu", "gpu"))
    # -- outputs --------------------------------------------------------------------------------
    log_every: int = _opt(0, "progress every N steps (default: about 10 lines)")
    memory_watch: str = _opt("sampled", "trace the allocations of every step, or of a sample (the first "
                             "3, then 1 in 50: a traced step is a few per cent slower)",
                             choices=("sampled", "every"))
    trace: str = _opt(None, "write a Chrome trace per rank into DIR", metavar="DIR")
    metrics_json: str = _opt(None, "rank 0 writes the run's metrics here", metavar="FILE")
    save: str = _opt(None, "rank 0 saves the fp32 parameters by name", metavar="FILE.npz")
    checkpoint_dir: str = _opt(None, "save checkpoints into D/step_NNNNNN/", metavar="D")
    checkpoint_every: int = _opt(0, "save a checkpoint every K steps (and after the last step; 0: only then)",
                                 metavar="K")
    resume: bool = _opt(False, "continue from the newest complete checkpoint in --checkpoint-dir")
    elastic: bool = _opt(False, "go on past a lost rank (under ringcomm.launch --on-failure continue): the "
                         "survivors shrink the world, rebuild the job and redo the step (ddp, zero1-3)")
    overwrite: bool = _opt(False, "replace the checkpoints already in --checkpoint-dir (without it, or "
                           "--resume, a run refuses to start there)")

    @property
    def model_parallel(self):
        return self.cp > 1 or self.pp > 1 or self.tp > 1


def _parse_widths(text):
    try:
        widths = tuple(int(w) for w in str(text).split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers must be comma-separated integers, got {text!r}") from None
    return widths


def build_parser():
    p = argparse.ArgumentParser(prog="python -m ringcomm.train", allow_abbrev=False,
                                description="Train a model with data, context, pipeline and tensor parallelism.")
    for f in fields(TrainConfig):
        meta, flag = dict(f.metadata), "--" + f.name.replace("_", "-")
        kw = dict(help=meta.pop("help"))
        if f.type is bool or f.type == "bool":
            if f.default:
                p.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false", **kw)
            else:
                p.add_argument(flag, action="store_true", **kw)
            continue
        kind = {"int": int, "float": float, "str": str}.get(getattr(f.type, "__name__", str(f.type)), str)
        if meta.pop("parse", None) == "widths":
            kind = _parse_widths
        p.add_argument(flag, type=kind, default=f.default, **meta, **kw)
    p.add_argument("--main-job", action="store_true", help="the demonstration run: " + ", ".join(
        f"{k.replace('_', '-')}={v}" for k, v in MAIN_JOB.items()))
    return p


def parse_args(argv=None):
    """The command line as a validated :class:`TrainConfig` (argparse errors exit 2)."""
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    if args.main_job and args.model != "mlp":
        p.error("--main-job is the MLP demonstration run; it takes no --model gpt")
    if args.main_job:
        for key, value in MAIN_JOB.items():
            if key not in given:
                setattr(args, key, _parse_widths(value) if key == "layers" else value)
    if args.model == "gpt":
        for key, value in GPT_DEFAULTS.items():
            if key not in given:
                setattr(args, key, value)
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k != "main_job"})
    try:
        validate(cfg)
    except ValueError as e:
        p.error(str(e))
    return cfg


def validate(cfg, world_size=None):
    """Raise ValueError, naming the flags, for any setting or combination that cannot work.
    With ``world_size`` the layout is checked against it too (and ``cfg.dp`` filled in)."""
    _check_flags(cfg)
    (_check_mlp if cfg.model == "mlp" else _check_gpt)(cfg)
    if cfg.strategy == "single" and cfg.model_parallel:
        raise ValueError("--strategy single is the one-process reference: it takes no --cp/--pp/--tp")
    if cfg.micro_batches > 1 and cfg.pp == 1:
        raise ValueError("--micro-batches is for pipelines: it needs --pp > 1")
    if world_size is None:
        return cfg
    return dataclasses.replace(cfg, dp=_data_parallel_size(cfg, world_size))


def _check_flags(cfg):
    """Each flag alone, and the ones that need another."""
    if len(cfg.layers) < 2 or min(cfg.layers) < 1:
        raise ValueError("--layers needs at least an input and an output width, all positive")
    if cfg.steps < 0 or cfg.batch_size < 1 or cfg.lr <= 0:
        raise ValueError("--steps must be >= 0, --batch-size >= 1 and --lr > 0")
    if cfg.offload and not cfg.strategy.startswith("zero"):
        raise ValueError("--offload needs --strategy zero1, zero2 or zero3")
    if (cfg.resume or cfg.checkpoint_every) and not cfg.checkpoint_dir:
        raise ValueError("--resume and --checkpoint-every need --checkpoint-dir")
    if cfg.overwrite and (cfg.resume or not cfg.checkpoint_dir):
        raise ValueError("--overwrite replaces the checkpoints in --checkpoint-dir: it needs --checkpoint-dir "
                         "and contradicts --resume")
    if cfg.checkpoint_every < 0:
        raise ValueError("--checkpoint-every must be >= 0")
    if cfg.clip_grad_norm is not None and cfg.clip_grad_norm <= 0:
        raise ValueError("--clip-grad-norm must be > 0")
    for name in ("cp", "pp", "tp", "micro_batches"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.dp < 0:
        raise ValueError("--dp must be >= 0 (0: whatever the world size leaves)")


def _check_mlp(cfg):
    if cfg.cp > 1 or cfg.sp:
        raise ValueError("--cp and --sp split sequences: they need --model gpt")
    if cfg.pp > len(cfg.layers) - 1:
        raise ValueError(f"--pp {cfg.pp} exceeds the MLP's {len(cfg.layers) - 1} layers (--layers)")


def _check_gpt(cfg):
    for name in ("n_layer", "n_head", "d_model", "seq_len", "vocab"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.pp > cfg.n_layer + 2:
        raise ValueError(f"--pp {cfg.pp} exceeds the GPT's {cfg.n_layer + 2} layers (embedding, "
                         f"--n-layer {cfg.n_layer} blocks, head)")
    if cfg.d_model % cfg.n_head:
        raise ValueError(f"--d-model {cfg.d_model} must divide by --n-head {cfg.n_head}")
    if cfg.n_head % cfg.tp:
        raise ValueError(f"--n-head {cfg.n_head} must divide by --tp {cfg.tp} (attention is split by heads)")
    if cfg.cp > 1 and cfg.seq_len % (2 * cfg.cp):
        raise ValueError(f"--seq-len {cfg.seq_len} must divide by 2·--cp = {2 * cfg.cp} (causal load balance)")
    if cfg.sp and cfg.tp == 1:
        raise ValueError("--sp shards the sequence over the tp group: it needs --tp > 1")
    if cfg.sp and (cfg.seq_len // cfg.cp) % cfg.tp:
        raise ValueError(f"--sp needs the positions per cp rank ({cfg.seq_len // cfg.cp}) to divide by --tp {cfg.tp}")


def uneven_batches(cfg):
    """Whether the ranks' shares of a global batch may differ by a row: with ``--elastic`` on
    a data-parallel layout (a world shrunk by a loss divides the batch as it can)."""
    return cfg.elastic and not cfg.model_parallel


def _data_parallel_size(cfg, world_size):
    """The data-parallel size the world leaves (``--dp``, or N / (cp·pp·tp)), checked
    against the world, the batch and the micro-batches."""
    if cfg.strategy == "single" and world_size != 1:
        raise ValueError("--strategy single is the one-process reference; launch it with --nproc 1")
    inner = cfg.cp * cfg.pp * cfg.tp
    if not cfg.dp and world_size % inner:
        raise ValueError(f"--cp {cfg.cp} × --pp {cfg.pp} × --tp {cfg.tp} = {inner} does not divide "
                         f"the world of {world_size} ranks")
    dp = cfg.dp or world_size // inner
    if dp * inner != world_size:
        raise ValueError(f"--dp {dp} × --cp {cfg.cp} × --pp {cfg.pp} × --tp {cfg.tp} = {dp * inner}, "
                         f"but the world has {world_size} ranks")
    if cfg.batch_size % dp and not uneven_batches(cfg):
        size = f"world size {world_size}" if dp == world_size else f"data-parallel size (--dp) {dp}"
        raise ValueError(f"--batch-size {cfg.batch_size} does not divide by the {size}")
    if (cfg.batch_size // dp) % cfg.micro_batches:
        raise ValueError(f"the {cfg.batch_size // dp} samples per data-parallel rank do not divide into "
                         f"--micro-batches {cfg.micro_batches}")
    return dp
