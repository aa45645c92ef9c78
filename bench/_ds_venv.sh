#!/usr/bin/env bash
# Create the optional DeepSpeed baseline venv used by bench/engine_bench.py.
#
# It is deliberately separate from the project's .venv: DeepSpeed pulls in packages the project does not need.
# torch is pinned to 2.13.0 (the CPU build on this machine's pip find-links): an unpinned torch pulls a multi-GB CUDA
# build when DeepSpeed asks for it.
# Usage: bash bench/_ds_venv.sh [VENV_DIR]   (default: /work/ds-venv, or $EZ_DS_VENV)
set -euo pipefail
VENV="${1:-${EZ_DS_VENV:-/work/ds-venv}}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet "torch==2.13.0" psutil numpy setuptools wheel
# DeepSpeed ships as an sdist whose setup.py imports torch: build it without isolation so the build sees the pinned
# torch above instead of resolving its own (which would pull a CUDA build). DS_BUILD_OPS=0: no op pre-compilation.
DS_BUILD_OPS=0 "$VENV/bin/pip" install --quiet --no-build-isolation "torch==2.13.0" "deepspeed==0.19.8"
DS_ACCELERATOR=cpu "$VENV/bin/python" -c "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'torch', torch.__version__)"
# DeepSpeed's CPU comm backend JIT-compiles a shared-memory op at init_distributed (minutes on a loaded 2-core
# machine; two ranks racing on it wait on a lock file). Build it once here so benchmark runs only load it.
DS_ACCELERATOR=cpu "$VENV/bin/python" -c "
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder('ShareMemCommBuilder')
print('ShareMemCommBuilder', 'prebuilt' if builder is None else builder.load())
"
