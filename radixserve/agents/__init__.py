"""What agent frameworks need from a model's text: tool calls and reasoning split out of it.

Pure functions over text, one module per output format, with no serving or model
imports, so that a new model's format is one parser and a test:

- :mod:`~radixserve.agents.jsonscan`: where a JSON value that is still being generated
  ends (or that it has not ended yet), for streaming arguments as they come.
- :mod:`~radixserve.agents.hermes` (Hermes / Qwen2.5 / Qwen3: ``<tool_call>{json}</tool_call>``),
  :mod:`~radixserve.agents.llama3` (Llama 3.1/3.2 JSON: ``{"name", "parameters"}``),
  :mod:`~radixserve.agents.mistral` (``[TOOL_CALLS][{...}]``): each a ``scan(text, final)``.
- :mod:`~radixserve.agents.reasoning`: ``<think>...</think>`` (Qwen3, DeepSeek-R1, GLM-4.5),
  Magistral's ``[THINK]`` and Kimi's ``◁think▷`` blocks.
- :mod:`~radixserve.agents.harmony`: gpt-oss's harmony channel messages, read once for both
  splits (reasoning from the analysis channel, calls from ``functions.*`` recipients).
- :mod:`~radixserve.agents.stream`: :class:`~radixserve.agents.stream.OutputParser`, which
  feeds text deltas through a reasoning parser and a tool parser and hands back content,
  reasoning and tool-call deltas in OpenAI's incremental shape.
- :mod:`~radixserve.agents.registry`: parsers by name, and the one a chat template implies.
- :mod:`~radixserve.agents.tool_grammar`: the constraint that forces a well-formed call
  (``tool_choice: "required"`` or a named function) in each format.
"""
