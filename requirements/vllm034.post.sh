set -euo pipefail
# vllm 0.34.0 without its dependencies: requirements/vllm034.txt installed them, less the
# flashinfer-python==0.7.3 the wheel pins (not served here) and the GPU kernel packages.
"$VENV/bin/python" -m pip install -q --no-deps vllm==0.34.0
