"""frontend_dsl: write LLM programs in Python against radixserve.

```python
from frontend_dsl import program, gen, select, system, user, assistant, RemoteBackend

@program
def classify(s, review):
    s += system("Classify the sentiment of movie reviews.")
    s += user(review)
    s += assistant("Sentiment: " + select("label", choices=["positive", "negative"]))

backend = RemoteBackend("tcp://127.0.0.1:5557")      # or EngineBackend(Engine(...))
print(classify.run(review="A delight.", backend=backend)["label"])
```

The package is torch-free: ``EngineBackend`` (the in-process engine) is imported lazily.
"""

from __future__ import annotations

from typing import Any

from frontend_dsl.backend import (
    Backend,
    BackendError,
    CallUsage,
    GenChunk,
    GenStream,
    ModelInfo,
    ScoreRequest,
    ScoreResult,
)
from frontend_dsl.chat_template import RoleFormat, render_chat_template
from frontend_dsl.fake_backend import FakeBackend
from frontend_dsl.ir import (
    assistant,
    gen,
    gen_bool,
    gen_float,
    gen_int,
    gen_json,
    gen_str,
    role,
    select,
    system,
    tool_result,
    user,
)
from frontend_dsl.program import (
    Program,
    batch_usage,
    function,
    get_default_backend,
    program,
    set_default_backend,
)
from frontend_dsl.state import ForkGroup, ProgramError, ProgramState
from frontend_dsl.tools import ToolReply, tool
from frontend_dsl.usage import ProgramUsage

__all__ = [
    "Backend",
    "BackendError",
    "CallUsage",
    "GenChunk",
    "GenStream",
    "ModelInfo",
    "ScoreRequest",
    "ScoreResult",
    "RoleFormat",
    "render_chat_template",
    "FakeBackend",
    "assistant",
    "gen",
    "gen_bool",
    "gen_float",
    "gen_int",
    "gen_json",
    "gen_str",
    "role",
    "select",
    "system",
    "tool",
    "tool_result",
    "ToolReply",
    "user",
    "Program",
    "batch_usage",
    "function",
    "get_default_backend",
    "program",
    "set_default_backend",
    "ForkGroup",
    "ProgramError",
    "ProgramState",
    "ProgramUsage",
]  # EngineBackend and RemoteBackend are lazy attributes, left out of `import *` (torch, zmq)


def __getattr__(name: str) -> Any:
    # Lazy: EngineBackend pulls in torch and the engine; RemoteBackend pulls in zmq.
    if name == "EngineBackend":
        from frontend_dsl.engine_backend import EngineBackend

        return EngineBackend
    if name == "RemoteBackend":
        from frontend_dsl.remote_backend import RemoteBackend

        return RemoteBackend
    raise AttributeError(f"module 'frontend_dsl' has no attribute {name!r}")
