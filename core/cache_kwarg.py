"""The name transformers gives a decoder's KV cache, for every place draftsmith passes, reads or receives it.

transformers 5.24 renamed the cache argument of its decoders (``LlamaForCausalLM``, ``LlamaModel``, the
decoder layers, the attention modules, ``generate``) and the cache field of their outputs from
``past_key_values`` to ``cache``. The old name still works until 5.40 through ``deprecate_kwarg``, at
the price of a FutureWarning per call and a logged warning per output read; but a forward hook sees
the keywords as the caller passed them, so a hook that looks for ``past_key_values`` finds nothing.

So each call site names the cache through this module, with the installed release's own name, and
nothing of ours depends on which one it is:

- ``model(ids, **cache_kwargs(cache))`` hands a transformers decoder (or one of draftsmith's modules
  that stand in for the target, see :func:`takes_cache_kwarg`) its cache;
- ``cache_in(output)`` reads it from a transformers output, ``cache_in(kwargs)`` from the keywords a
  decoder layer's forward hook received;
- ``output_class(**cache_kwargs(cache), ...)`` builds an output as transformers would.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from transformers.models.llama.modeling_llama import LlamaModel


def _installed_cache_kwarg() -> str:
    # The signature rather than the version number: it is what a call is checked against, and
    # ``inspect.signature`` follows transformers' decorators (functools.wraps) to the real parameters.
    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


CACHE_KWARG = _installed_cache_kwarg()


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{name: cache}`` under the installed transformers' name, to unpack into a decoder's call."""
    return {CACHE_KWARG: cache}


def cache_in(mapping: Mapping[str, Any]) -> Any:
    """The KV cache in a transformers output, or in the keywords a decoder layer's forward hook
    received (None when there is none)."""
    return mapping.get(CACHE_KWARG)


def takes_cache_kwarg(forward: Callable[..., Any]) -> Callable[..., Any]:
    """For draftsmith's own ``forward`` methods that stand in for the target (the runtime calls them as
    it calls the target, with :func:`cache_kwargs`): the decorated method receives the cache as its
    ``cache`` parameter, whatever the installed release calls it."""
    if CACHE_KWARG == "cache":
        return forward

    @functools.wraps(forward)
    def renamed(*args: Any, **kwargs: Any) -> Any:
        if CACHE_KWARG in kwargs:
            kwargs["cache"] = kwargs.pop(CACHE_KWARG)
        return forward(*args, **kwargs)

    return renamed
