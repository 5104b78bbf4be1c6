# torchvision/torchaudio break the vLLM import on the CPU build
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio || true
