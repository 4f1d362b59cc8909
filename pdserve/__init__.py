"""pdserve: disaggregated prefill/decode LLM serving.

The top-level names load lazily so that ``import pdserve.kv_cache`` (and the gateway, which has no
model) does not pay for the engine's imports.
"""

from typing import TYPE_CHECKING

__all__ = ["LLM", "Client", "CompletionOutput", "SamplingParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from pdserve.client import Client
    from pdserve.llm import LLM, CompletionOutput
    from pdserve.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in ("LLM", "CompletionOutput"):
        from pdserve import llm

        return getattr(llm, name)
    if name == "Client":
        from pdserve.client import Client

        return Client
    if name == "SamplingParams":
        from pdserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
