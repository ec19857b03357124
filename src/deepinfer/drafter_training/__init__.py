"""Training a DSpark draft head for a Llama-family target by self-distillation: prompts
(``prompts``), the target's replies and features (``dataset``), DSpark's loss (``objective``),
the loop, calibration and evaluation (``train``), and the whole recipe behind
``deepinfer train-drafter`` (``recipe``)."""
