"""Canonical `checkpoint_name` tags that fiddlejax's models put on their activations.

Remat policies and offloading refer to activations by these names, so every model tags the same
quantities the same way. `jax.ad_checkpoint.checkpoint_name(x, NAME)` is a no-op outside a policy.
"""

QUERY = "query_proj"        # attention query projection output  [B, T, H, Dh]
KEY = "key_proj"            # attention key projection output    [B, T, H, Dh]
VALUE = "value_proj"        # attention value projection output  [B, T, H, Dh]
CONTEXT = "attn_context"    # softmax(QK^T)V before the output projection [B, T, H, Dh]
ATTN_OUT = "attn_out"       # attention output projection        [B, T, D]
MLP_HIDDEN = "mlp_hidden"   # first MLP matmul, before the activation [B, T, F]
MLP_OUT = "mlp_out"         # second MLP matmul                  [B, T, D]

PROJECTIONS = (QUERY, KEY, VALUE, ATTN_OUT, MLP_HIDDEN, MLP_OUT)
ALL = (QUERY, KEY, VALUE, CONTEXT, ATTN_OUT, MLP_HIDDEN, MLP_OUT)
