# Sourced by this directory's calls: docs/bench/session25/common.sh (the project installed, B16, S1, S2)
# and the override strings of the switches they measure (sessions 31-32; P is on by default: P_OFF).
source docs/bench/session25/common.sh
D=precision.dense_weight_copies=true
H=precision.head_weight_copy=true
E=model.triton_embedding_grad=true
S=precision.save_swiglu_product=true
P_OFF=model.fused_loss_prescale=false
ALL=$D,$H,$E,$S
nvidia-smi --query-gpu=name --format=csv,noheader
