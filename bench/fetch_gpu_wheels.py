"""Download, on a machine with internet, the wheels a GPU machine without internet lacks for bench/gpu_check.py.

The GPU machines this project is lent have torch, transformers, safetensors, tokenizers, pyyaml, rich, numpy,
peft, accelerate, pytest and pytest-xdist, but not the packages below (isotrain's own dependencies from
pyproject.toml, and what those need). Each is fetched at the version installed here, the version CI resolves, as
a CPython 3.12 manylinux x86-64 wheel, into `.whl/` (ignored by git):

    python bench/fetch_gpu_wheels.py [--dest .whl] [--python-version 3.12]

then, on the GPU machine, from the repository root (the command docs/benchmarks.md gives):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && PYTHONPATH=/tmp/site python3 bench/gpu_check.py --out OUT
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# isotrain's dependencies that the GPU image lacks, then what they need (transitively) and it lacks too.
MISSING = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "blake3",
           "datasets", "dill", "multiprocess"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dest", type=Path, default=Path(__file__).resolve().parents[1] / ".whl")
    parser.add_argument("--python-version", default="3.12", help="The GPU machine's Python (major.minor).")
    args = parser.parse_args()
    pins = []
    for name in MISSING:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            print(f"{name} is not installed here; install isotrain first (pip install -e '.[test]')", file=sys.stderr)
            return 2
    args.dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               args.python_version, "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "-d",
               str(args.dest), *pins]
    done = subprocess.run(command)
    if done.returncode != 0:
        return done.returncode
    wheels = sorted(args.dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
