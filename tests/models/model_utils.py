import jax
from flax import nnx


def jit_model(model):
    """``model``'s forward as one jitted function of (tokens, positions, segment_ids, cache):
    eager calls re-trace the XLA attention loops on every call, which is slow on CPU."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens, positions=None, segment_ids=None, cache=None):
        return nnx.merge(graphdef, state)(tokens, positions, segment_ids=segment_ids, cache=cache)

    def call(tokens, positions=None, *, segment_ids=None, cache=None):
        return run(state, tokens, positions, segment_ids, cache)

    call.config = model.config
    return call
