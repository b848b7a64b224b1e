"""`RewardModel`: a Bradley-Terry reward model as transformers saves it (*ForSequenceClassification
with one label), scoring conversations forward-only (`reward.model_path`; the `model` term of
reward.name).

Where it runs, and why: in the trainer's process (the controller), on its device (the GPU when there
is one, in bf16; fp32 on the CPU), beside the reward runner, not on the training ranks as the
reference model is. A reward model has its own tokenizer and chat format (a Llama-based RM scoring a
Qwen policy is common), so the training batch's token ids and packing cannot be reused; it runs any
architecture transformers loads, with transformers' own pooling (the last token that is not padding),
so its score equals transformers' for the same text; and it is one forward per sample at reward
time, before the training half of the step. A reward model too large for one device would go on the
training ranks (the critic's value-head path, for a model with the policy's tokenizer): not built.

What it scores: the conversation as the policy saw it, the sample's prompt and response token ids
decoded with every token kept (the policy's chat template's rendering; `RewardInput.conversation`),
tokenized by the reward model's tokenizer without added special tokens (the text is whole already).
Batches of `batch_size` texts of similar length, padded on the right with the model's pad token: a
causal model's last real position does not see the padding, and transformers pools at that position
for a padded row as for the unpadded text. A model without a pad token scores one text at a time.

Imports torch and transformers: only the trainer imports this module (never a reward worker).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rlloom.models.checkpoint import load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_reward_model(path: str) -> None:
    """Raise ValueError (one line: the rule and the fix) unless `path` looks like a one-label sequence
    classifier with a tokenizer; reads config.json only, so it runs before anything loads."""
    folder = Path(path).expanduser()
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{config_file} cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:160]}). Fix: pass the "
            "folder transformers' save_pretrained wrote for the reward model"
        ) from None
    arch = (config.get("architectures") or [""])[0] if isinstance(config, dict) else ""
    if not arch.endswith("ForSequenceClassification"):
        raise ValueError(
            f"it is a {arch or 'model without architectures'}, not a reward model (*ForSequenceClassification). "
            "Fix: pass a Bradley-Terry reward model saved by transformers (AutoModelForSequenceClassification, "
            "num_labels=1)"
        )
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
    if labels != 1:
        raise ValueError(
            f"it is a {arch} with {labels} labels, and a reward model gives one score. Fix: pass a reward "
            "model with num_labels=1"
        )
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(
            f"the folder has no tokenizer ({', '.join(TOKENIZER_FILES)}). Fix: save the reward model's "
            "tokenizer into it"
        )


class RewardModel:
    """Scores of conversations under a sequence-classification reward model.

    Example: `RewardModel.load("/models/rm", batch_size=16)(["<|im_start|>user\\n2+2?..."])` ->
    `[1.73]`, the logit transformers' AutoModelForSequenceClassification gives the same text.
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int, device: torch.device) -> None:
        self.model, self.tokenizer, self.batch_size, self.device = model, tokenizer, batch_size, device
        self.pad_id: int | None = model.config.pad_token_id

    @classmethod
    def load(cls, path: str, *, batch_size: int) -> RewardModel:
        """The reward model of folder `path` on this process's device; ValueError (one line) when it
        does not load."""
        from transformers import AutoModelForSequenceClassification

        check_reward_model(path)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        try:  # a third-party loader of third-party files: any exception is the folder's
            tokenizer = load_tokenizer(path)
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
        except Exception as e:  # noqa: BLE001
            raise ValueError(
                f"it does not load ({type(e).__name__}: {' '.join(str(e).split())[:200]}). Fix: save the reward "
                "model and its tokenizer again with save_pretrained"
            ) from None
        return cls(model.to(device).eval(), tokenizer, batch_size=batch_size, device=device)

    def __call__(self, conversations: list[str]) -> list[float]:
        """One score per text, in order."""
        ids = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in conversations]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        size = self.batch_size if self.pad_id is not None else 1
        scores = [0.0] * len(ids)
        for lo in range(0, len(order), size):
            rows = order[lo : lo + size]
            for i, score in zip(rows, self._forward([ids[i] for i in rows])):
                scores[i] = score
        return scores

    @torch.no_grad()
    def _forward(self, rows: list[list[int]]) -> list[float]:
        """Scores of token rows, right-padded to the longest."""
        width = max(len(r) for r in rows)
        pad = self.pad_id if self.pad_id is not None else 0
        input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device)
        attention_mask = torch.tensor(
            [[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device
        )
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits[:, 0].float().tolist()
