"""Bundled example models, each a factory returning ``(module, example_inputs)``.

``gpt`` (nanoGPT-style, tied LM head; ``gpt_small`` is the default model), ``resnet``, ``unet``
(long skip connections) and ``hf`` (GPT-2, BERT and Llama built from ``transformers`` configs).
Every module returns a single tensor (logits or an image-shaped output).
"""

BUNDLED: dict[str, str] = {
    "gpt_tiny": "planner.examples.gpt:gpt_tiny",
    "gpt_small": "planner.examples.gpt:gpt_small",
    "gpt_medium": "planner.examples.gpt:gpt_medium",
    "resnet_small": "planner.examples.resnet:resnet_small",
    "unet_small": "planner.examples.unet:unet_small",
    "gpt2_small": "planner.examples.hf:gpt2_small",
    "bert_small": "planner.examples.hf:bert_small",
    "llama_small": "planner.examples.hf:llama_small",
    "llama_deep": "planner.examples.hf:llama_deep",
}
"""Every bundled model by short name -> its factory spec (``plan profile SPEC``); the benchmarks use it."""
DEFAULT_MODEL = BUNDLED["gpt_small"]
