import jax
from flax import nnx


def jit_model(model):
    """``model``'s forward as one jitted function of (tokens, positions, segment_ids, cache,
    logits_at):
    eager calls re-trace the XLA attention loops on every call, which is slow on CPU."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens, positions=None, segment_ids=None, cache=None, logits_at=None):
        model = nnx.merge(graphdef, state)
        return model(tokens, positions, segment_ids=segment_ids, cache=cache, logits_at=logits_at)

    def call(tokens, positions=None, *, segment_ids=None, cache=None, logits_at=None):
        return run(state, tokens, positions, segment_ids, cache, logits_at)

    call.config = model.config
    return call
