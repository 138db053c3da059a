"""Language models as variation operators: settings, the client, prompts, diffs, operators, the agent.

Only the settings are imported here (the config needs them); the rest loads on first use, and the
``openai`` package (extra ``llm``) only when a model is called.
"""

from evo.llm.settings import AgenticSettings, LLMSettings, ModelSettings, PromptSettings

__all__ = ["LLM_OPERATORS", "AgenticSettings", "LLMSettings", "ModelSettings", "PromptSettings"]

LLM_OPERATORS = ("llm_diff", "llm_rewrite", "llm_params", "agentic")
"""Names of the model-backed operators (weights in ``search.operators.weights``)."""
