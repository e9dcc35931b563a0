"""The deployment plan: which model, which binaries, where each worker runs
(--device, --gpus, --gpu-mem-fraction) and the deployment's CURVE keys. What
cannot run is a Failure, raised before anything starts."""

import os
import subprocess
import sys
from pathlib import Path

from .util import REPO, Failure, info

# The model `up` and `demo` serve when --model is not given: kdn's own small
# trained model (models/kdn-qa, made by tools/train/), which answers questions
# about the documents in its prompt. If it is missing, the generated `small`
# preset (random weights) is made and served instead.
DEFAULT_MODEL = REPO / "models" / "kdn-qa"
FALLBACK_MODEL = REPO / "models" / "generated" / "small"
FALLBACK_MODEL_MKMODEL_ARGS = ["--preset", "small", "--seed", "0"]

# With --device cuda and no --gpu-mem-fraction, the k workers on one GPU share
# this part of its memory equally (each 0.9/k, rounded down to 4 decimals);
# for one worker it is kdn-prefill/kdn-decode's own default, 0.9. The rest is
# left to the CUDA context of each worker and to other programs.
GPU_SHARE = 0.9


class WorkerDevice:
    """Where one worker's engine runs: "cpu" or "cuda:N"; for cuda, the share
    of that GPU's memory it may take (kdn-prefill/kdn-decode --gpu-mem-fraction)."""

    def __init__(self, name, fraction=None):
        self.name = name
        self.fraction = fraction

    def flags(self):
        """The worker flags that say so: none for cpu, so that a CPU deployment
        passes what it always passed (and runs binaries older than --device)."""
        if self.name == "cpu":
            return []
        return ["--device", self.name, "--gpu-mem-fraction", repr(self.fraction)]

    def describe(self):
        if self.fraction is None:
            return self.name
        return "%s (%g of its memory)" % (self.name, self.fraction)


def worker_names(prefill, decode):
    """[(name, role)] of the workers in the order they start and are dealt
    over --gpus: the prefill workers, then the decode workers."""
    return ([("prefill-%d" % i, "prefill") for i in range(prefill)] +
            [("decode-%d" % j, "decode") for j in range(decode)])


def plan_devices(a):
    """{worker name: WorkerDevice} from --device, --gpus and --gpu-mem-fraction.
    A combination that cannot run is a Failure, raised before anything starts."""
    workers = worker_names(a.prefill, a.decode)
    if a.device == "cpu":
        for flag, value in (("--gpus", a.gpus), ("--gpu-mem-fraction", a.gpu_mem_fraction)):
            if value is not None:
                raise Failure("%s needs --device cuda (with --device cpu no worker uses a GPU)"
                              % flag)
        return {name: WorkerDevice("cpu") for name, _ in workers}
    gpus = a.gpus if a.gpus is not None else [0]
    if len(gpus) > len(workers):
        idle = gpus[len(workers):]
        raise Failure("--gpus lists %d GPUs for %d workers (%d prefill + %d decode): %s %s "
                      "would sit idle" % (len(gpus), len(workers), a.prefill, a.decode,
                                          "GPU" if len(idle) == 1 else "GPUs",
                                          ", ".join(str(g) for g in idle)))
    on_gpu = {g: [] for g in gpus}
    for k, (name, _) in enumerate(workers):
        on_gpu[gpus[k % len(gpus)]].append(name)
    plan = {}
    for g, names in on_gpu.items():
        if a.gpu_mem_fraction is None:
            fraction = (round(GPU_SHARE * 10000) // len(names)) / 10000
        else:
            fraction = a.gpu_mem_fraction
            if fraction * len(names) > 1.0 + 1e-9:
                raise Failure("--gpu-mem-fraction %g: the %d workers on GPU %d (%s) would take "
                              "%g of its memory, more than all of it; give at most %g, or list "
                              "more --gpus" % (fraction, len(names), g, ", ".join(names),
                                               fraction * len(names),
                                               (10000 // len(names)) / 10000))
        for name in names:
            plan[name] = WorkerDevice("cuda:%d" % g, fraction)
    return plan




# The deployment's CURVE keys (docs/kvbus.md, "Authenticated sockets"): the
# members' (workers, kdn-store) and the router's.
CURVE_KEY_NAMES = ("curve.key", "router.key")


def curve_key_paths(run_dir):
    return tuple((Path(run_dir) / name).resolve() for name in CURVE_KEY_NAMES)



def remove_curve_keys(run_dir):
    for path in curve_key_paths(run_dir):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def make_curve_keys(bin_dir, run_dir):
    """New deployment keys, run_dir/curve.key and run_dir/router.key
    (kdn-keygen writes them with mode 0600), replacing the last deployment's.
    Returns their absolute paths."""
    remove_curve_keys(run_dir)
    members, router = curve_key_paths(run_dir)
    r = subprocess.run([str(bin_dir / "kdn-keygen"), str(members), "--router", str(router)],
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    if r.returncode != 0:
        raise Failure("kdn-keygen could not write %s: %s" % (members, r.stderr.strip()))
    return members, router


def default_bin_dir():
    """bin/ beside launch/ in an unpacked release (scripts/package.sh), else
    the source tree's build/bin."""
    packaged = REPO / "bin"
    return packaged if (packaged / "kdn-router").is_file() else REPO / "build" / "bin"


def bin_dir_from_env():
    env = os.environ.get("KDN_BIN_DIR")
    return Path(env).resolve() if env else default_bin_dir()


def require_bins(bin_dir, names):
    for n in names:
        path = bin_dir / n
        if not os.access(path, os.X_OK):
            raise Failure("%s is missing; build first: scripts/build.sh (or set --bin-dir / KDN_BIN_DIR)"
                          % path)


def check_model(path):
    """`path` resolved, when it is a model folder (with config.json) or a GGUF
    file (it begins with GGUF's magic); Failure otherwise."""
    model = Path(path).resolve()
    if model.is_file():
        try:
            with open(model, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise Failure("cannot read %s: %s" % (path, e.strerror))
        if magic != b"GGUF":
            raise Failure("%s is neither a model folder nor a GGUF file" % path)
        return model
    if not model.is_dir():
        raise Failure("model %s does not exist (a model folder or a .gguf file)" % path)
    if not (model / "config.json").is_file():
        raise Failure("%s is not a model folder (no config.json)" % path)
    return model


def resolve_model(args, bin_dir, make=True):
    """The model folder or GGUF file to serve. Without --model and without models/kdn-qa,
    the fallback model, generated first when missing (unless `make` is False:
    --dry-run generates nothing)."""
    if args.model is not None:
        return check_model(args.model)
    if (DEFAULT_MODEL / "model.safetensors").is_file():
        return DEFAULT_MODEL
    model = FALLBACK_MODEL
    if make and not (model / "model.safetensors").is_file():
        require_bins(bin_dir, ["kdn-mkmodel"])
        cmd = [str(bin_dir / "kdn-mkmodel")] + FALLBACK_MODEL_MKMODEL_ARGS + ["--out", str(model)]
        info("%s is missing; generating a random-weight model instead: %s"
             % (DEFAULT_MODEL, " ".join(cmd)))
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr)
        if r.returncode != 0 or not (model / "model.safetensors").is_file():
            raise Failure("kdn-mkmodel failed (exit code %d)" % r.returncode)
    return model

