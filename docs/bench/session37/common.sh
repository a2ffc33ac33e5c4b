# Sourced by this directory's device scripts: session 25's environment, install and variant strings, and
# the fp8_blockwise ones: F8 the recipe (bf16 optimizer state, as B16's), G the Gluon experts, C the
# optimizer's bf16 expert copies (session 37).
source docs/bench/session25/common.sh
F8=optimizer.state_dtype=bf16,precision.recipe=fp8_blockwise
G=precision.fp8_experts=gluon
C=precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
