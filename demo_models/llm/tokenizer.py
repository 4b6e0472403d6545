"""A byte-level BPE tokenizer for the embedded LLM, trained with Hugging Face ``tokenizers`` on our corpus.

Digits are split one per token so that numbers (passkeys, values) are copied digit by digit. Saved as a
``PreTrainedTokenizerFast`` so ``AutoTokenizer.from_pretrained`` loads it from the checkpoint directory.
"""

from __future__ import annotations

from collections.abc import Iterable

SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Returns a ``transformers.PreTrainedTokenizerFast`` with bos ``<bos>``, eos ``<eos>``, pad ``<pad>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
