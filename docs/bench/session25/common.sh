# Sourced by this directory's device scripts: the multicast-off environment, the project installed,
# and the variant strings and shapes their rows use (tools/bench_train.py --variant NAME:...).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# once per call: scripts that source this twice (session 42's common.sh) or run each other skip the reinstall
if [[ -z "${MOETRON_BENCH_INSTALLED:-}" ]]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
  export MOETRON_BENCH_INSTALLED=1
fi
B16=optimizer.state_dtype=bf16,precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
MXC=$B16,precision.recipe=mxfp8,precision.backend=emulated
X=precision.emulated_save_x_bf16=true
I=precision.quantize_input_once=true
Q=precision.quantized_expert_copies=true
F8RFC=$B16,precision.recipe=fp8_rowwise,precision.fp8_fast_accum=true
S1="--preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 --seq-len 4096 --batch 4 --compile"
S2="--preset olmo3-moe-8e --model.n_layers=4 --model.vocab_size=100352 --seq-len 4096 --batch 4 --compile"
