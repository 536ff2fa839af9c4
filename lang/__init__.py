"""radixlm: a language for structured LLM programs, served by a radix-cache runtime.

Names follow SGLang's frontend, so `import radixlm as sgl` runs SGLang programs unchanged.
Importing this package is cheap: nothing here imports torch or transformers.
"""

from .backend import Backend, BackendError, flush_cache, get_server_info, set_default_backend
from .choices import (ChoiceDecision, ChoicesMethod, greedy_token_selection, token_length_normalized,
                      unconditional_likelihood_normalized)
from .function import SglFunction, function
from .ir import (assistant, assistant_begin, assistant_end, gen, gen_int, gen_string, image, select,
                 separate_reasoning, system, system_begin, system_end, tool, user, user_begin, user_end, video)
from .openai_backend import OpenAI
from .runtime import Runtime
from .runtime_endpoint import RuntimeEndpoint
from .state import ProgramState, ProgramStateGroup

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendError", "ChoiceDecision", "ChoicesMethod", "OpenAI", "ProgramState", "ProgramStateGroup",
    "Runtime", "RuntimeEndpoint", "SglFunction", "assistant", "assistant_begin", "assistant_end",
    "flush_cache", "function", "gen", "gen_int", "gen_string", "get_server_info", "greedy_token_selection", "image",
    "select", "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "tool", "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video",
    "__version__",
]
