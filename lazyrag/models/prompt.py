"""How a prompt is laid out: [preamble][chunk]...[chunk][question suffix].

The preamble is stored with the index (every chunk was encoded after it), so the
same token ids reach the model in every mode. Models with a chat template get the
documents and question inside one user turn; others get plain text.
"""

from __future__ import annotations

INSTRUCTION = "Answer the question using the documents below. Answer briefly."
SEPARATOR = "\n\n"   # appended to every stored chunk so documents stay apart
_SENTINEL = "\x00LAZYRAG\x00"


class PromptFormat:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}],
                                                 add_generation_prompt=True, tokenize=False)
            head, tail = text.split(_SENTINEL)
        else:
            head, tail = tokenizer.bos_token or "", ""
        self.preamble_text = f"{head}{INSTRUCTION}\n\n"
        # with a chat template the assistant turn follows; plain text needs a cue
        self.question_tail = tail or "\nAnswer:"

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def preamble_ids(self) -> list[int]:
        return self.encode(self.preamble_text)

    def separator_ids(self) -> list[int]:
        return self.encode(SEPARATOR)

    def question_ids(self, question: str) -> list[int]:
        return self.encode("Question: " + question.strip() + self.question_tail)
