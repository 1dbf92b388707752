"""Bundled example models, each a factory returning ``(module, example_inputs)``.

``gpt`` (nanoGPT-style, tied LM head; ``gpt_small`` is the default model), ``resnet``, ``unet``
(long skip connections) and ``hf`` (GPT-2, BERT and Llama built from ``transformers`` configs).
Every module returns a single tensor (logits or an image-shaped output).
"""
