"""Record formats: dict records -> token ids with response masks -> fixed-shape numpy arrays.

Five formats (``DataConfig.format``), with their canonical fields (renamed through
``DataConfig.field_map``, e.g. ``{"prompt": "question"}``):

- ``preference``: ``prompt``, ``chosen``, ``rejected`` — DPO family and reward models.
  Each value is plain text or a list of chat messages. ``prompt`` may be absent when
  ``chosen`` and ``rejected`` are full conversations sharing their leading messages
  (Anthropic-HH style): the shared messages become the prompt. Optional ``margin``: a
  number per pair, how much better ``chosen`` is (Llama 2's graded preferences, used by
  the reward model with ``reward_model.use_margin``); absent (or null) it is 0, unless the
  encoder is told it is required (``required_fields``).
- ``unpaired``: ``prompt``, ``completion``, ``label`` (bool or 0/1) — KTO.
- ``sft``: ``messages`` (a conversation); the loss covers assistant turns only.
- ``text``: ``text`` (a plain string) — raw text, every token trained on (continued
  pre-training, PPO-ptx). Never templated: tokenised with the tokenizer's special tokens
  (e.g. BOS), ``eos_token`` appended unless it already ends with it (as TRL does for
  language-modelling data). The first token is the "prompt" (it has no prefix to be
  predicted from), every later token is response; a text over ``min(T, R + 1)`` tokens
  is cut at its end (``reject``: a ``too_long`` bad record).
- ``prompt``: ``prompt`` (or ``question``) and optionally ``answer`` — prompt sets for
  online RL; the whole record travels with the batch as the reference the verifiers need.
- ``steps``: ``prompt`` (or ``question``), ``steps`` (a non-empty list of non-empty
  strings, the reasoning steps of one solution) and ``labels`` (one per step: true/false,
  0/1, or a soft label in [0, 1], e.g. Math-Shepherd's estimated success rate) — process
  reward models. The response is the steps joined by ``step_delimiter`` (a step may not
  contain it, so the text splits back into the same steps when a PRM scores a sampled
  completion), followed by the end-of-turn token; each step is tokenised on its own and
  *ends* at its last token (its delimiter; for the last step, the end-of-turn token):
  ``step_mask [T]`` is 1 there and ``step_labels [T]`` holds the step's label there.

Chat messages are ``{"role": str, "content": str}`` dicts and always go through the
tokenizer's chat template. Plain-text fields go through it too when
``apply_chat_template`` is on (a text prompt becomes a user turn, preceded by
``system_prompt`` if set; a text response becomes an assistant turn); with it off they are
used verbatim (the prompt with the tokenizer's special tokens, e.g. BOS, the response
followed by the end-of-turn token).

The response of each example is the text after the prompt. Its loss mask marks assistant
content *including* the end-of-turn token (``tokenizer.eos_token``; SmolLM2's
``<|im_end|>``, which is also its pad token) and nothing after it; a response cut by
truncation has no end-of-turn token. Segments are tokenised separately at the
prompt/response boundary, exactly as a sampler sees them (prompt ids, then generated ids).

Truncation (``max_prompt_length`` P, ``max_length`` T, ``max_response_length`` R):

- ``reject``: a record over any limit is a ``too_long`` bad record (an error, or a counted
  skip under ``on_bad_record: skip``).
- otherwise a prompt over P keeps its last P tokens, and a response over ``min(R, T-1)`` is
  cut at the end; then, if prompt + longest response still exceed T, ``keep_end`` drops
  tokens from the start of the prompt, ``truncate_response`` cuts the responses' ends.

Every cut is flagged on the :class:`Encoded` result and counted by the pipeline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from alignax.data.sources import BadRecordError

FORMATS = ("preference", "unpaired", "sft", "prompt", "text", "steps")
TRUNCATIONS = ("keep_end", "truncate_response", "reject")

# Canonical field -> record keys tried in order when field_map does not name one.
DEFAULT_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "preference": {"prompt": ("prompt",), "chosen": ("chosen",), "rejected": ("rejected",), "margin": ("margin",)},
    "unpaired": {"prompt": ("prompt",), "completion": ("completion",), "label": ("label",)},
    "sft": {"messages": ("messages",)},
    "prompt": {"prompt": ("prompt", "question"), "answer": ("answer",)},
    "text": {"text": ("text",)},
    "steps": {"prompt": ("prompt", "question"), "steps": ("steps",), "labels": ("labels",)},
}
# Fields a record may lack; ``required_fields`` makes them mandatory (e.g. ``margin``
# under ``reward_model.use_margin``).
OPTIONAL_FIELDS: dict[str, tuple[str, ...]] = {"preference": ("prompt", "margin"), "prompt": ("answer",)}

_MISSING = object()


@dataclasses.dataclass
class Encoded:
    """One tokenised record before padding.

    ``prompt``: prompt ids. ``responses``: name -> (ids, mask) with mask 1 on trained
    tokens (one entry ``"response"`` for unpaired/sft/text, ``"chosen"``/``"rejected"``
    for pairs, none for prompt sets). ``label``: KTO label. ``margin``: a pair's margin
    (``None`` when the record has none). ``reference``: the record, for prompt sets.
    ``step_labels``: format ``steps``: the label of each step whose end is in the
    response (``responses["response"]``'s mask is 1 exactly on step ends there).
    ``truncated_prompt`` / ``truncated_response``: what truncation did. ``full_prompt``:
    the prompt ids before truncation cut them (``None`` when ``prompt`` is whole, and for
    prompt sets, cut at a fixed length): ``keep_end`` cuts a prompt by its responses'
    lengths, and the pipeline's prompt-grouped train/eval split groups records by prompt
    whatever their responses.
    """

    prompt: list[int]
    responses: dict[str, tuple[list[int], list[int]]]
    label: int | None = None
    margin: float | None = None
    reference: dict | None = None
    truncated_prompt: bool = False
    truncated_response: bool = False
    full_prompt: list[int] | None = None
    step_labels: list[float] | None = None


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, Mapping) for m in value)


def _check_messages(value: list, field: str) -> list[dict]:
    messages = []
    for i, message in enumerate(value):
        for key in ("role", "content"):
            if key not in message:
                raise BadRecordError("missing_field", f"{field}[{i}].{key}", "message lacks this key")
            if not isinstance(message[key], str):
                raise BadRecordError(
                    "invalid", f"{field}[{i}].{key}", f"must be a string, got {type(message[key]).__name__}"
                )
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


class Encoder:
    """Turns records of one format into :class:`Encoded` ids and then into padded arrays.

    Args:
      tokenizer: a ``transformers`` fast tokenizer; its ``chat_template`` renders
        messages, ``eos_token`` ends every response, ``pad_token`` (else eos) pads.
      format: one of :data:`FORMATS`.
      field_map: canonical field -> record key.
      apply_chat_template, system_prompt, max_length, max_prompt_length,
      max_response_length, truncation: as in :class:`alignax.data.DataConfig`.
      required_fields: optional fields of the format (:data:`OPTIONAL_FIELDS`) that
        every record must carry here (a record without one is a ``missing_field`` bad
        record), e.g. ``("margin",)`` for a reward model trained with margins.
    """

    def __init__(
        self,
        tokenizer,
        *,
        format: str,
        field_map: Mapping[str, str] | None = None,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        max_length: int = 1024,
        max_prompt_length: int = 512,
        max_response_length: int | None = None,
        truncation: str = "keep_end",
        required_fields: Sequence[str] = (),
        step_delimiter: str = "\n",
    ):
        if format not in FORMATS:
            raise ValueError(f"unknown data.format {format!r}; valid: {', '.join(FORMATS)}")
        if truncation not in TRUNCATIONS:
            raise ValueError(f"unknown data.truncation {truncation!r}; valid: {', '.join(TRUNCATIONS)}")
        field_map = dict(field_map or {})
        unknown = set(field_map) - set(DEFAULT_FIELDS[format])
        if unknown:
            raise ValueError(
                f"data.field_map names {', '.join(sorted(unknown))}, not fields of format {format!r}; "
                f"valid: {', '.join(DEFAULT_FIELDS[format])}"
            )
        not_optional = sorted(set(required_fields) - set(OPTIONAL_FIELDS.get(format, ())))
        if not_optional:
            raise ValueError(
                f"required_fields names {', '.join(not_optional)}, not optional fields of format {format!r}; "
                f"valid: {', '.join(OPTIONAL_FIELDS.get(format, ())) or 'none'}"
            )
        self.required_fields = tuple(required_fields)
        if not step_delimiter:
            raise ValueError("data.step_delimiter must be a non-empty string")
        self.step_delimiter = step_delimiter
        self.tokenizer = tokenizer
        self.format = format
        self.fields = {k: ((field_map[k],) if k in field_map else v) for k, v in DEFAULT_FIELDS[format].items()}
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.max_length = max_length
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        self.truncation = truncation
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has no eos_token; responses need an end-of-turn token")
        self.eot = tokenizer.eos_token
        self.eot_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eot_id)
        needs_template = format == "sft" or (apply_chat_template and format != "text")
        if needs_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"format {format!r} with apply_chat_template={apply_chat_template} needs a tokenizer "
                "with a chat_template"
            )

    # ----------------------------------------------------------------- fields
    def _get(self, record: Mapping, name: str, *, required: bool = True) -> Any:
        for key in self.fields[name]:
            if key in record:
                return record[key]
        if required or name in self.required_fields:
            tried = " or ".join(repr(k) for k in self.fields[name])
            why = f" (for {name})" if name not in self.required_fields else f" (for {name}, required here)"
            raise BadRecordError("missing_field", self.fields[name][0], f"record has no {tried}{why}")
        return _MISSING

    # --------------------------------------------------------------- tokenise
    def _ids(self, text: str, *, special: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _with_system(self, messages: list[dict]) -> list[dict]:
        if self.system_prompt is not None and (not messages or messages[0]["role"] != "system"):
            return [{"role": "system", "content": self.system_prompt}] + messages
        return messages

    def _as_messages(self, value: Any, field: str, role: str) -> list[dict]:
        if isinstance(value, str):
            if not value.strip():
                raise BadRecordError("empty", field, "empty text")
            return [{"role": role, "content": value}]
        if _is_messages(value):
            if not value:
                raise BadRecordError("empty", field, "empty message list")
            if not getattr(self.tokenizer, "chat_template", None):
                raise BadRecordError("invalid", field, "a message list needs a tokenizer with a chat_template")
            return _check_messages(value, field)
        raise BadRecordError("invalid", field, f"must be text or a list of messages, got {type(value).__name__}")

    def _conversation(self, messages: list[dict], train_from: int, field: str):
        """Prompt ids, response ids and response mask of a rendered conversation.

        Assistant messages at index >= ``train_from`` are trained (mask 1) up to and
        including their end-of-turn token; what the template adds after it is context
        (mask 0), and is dropped at the very end of the sequence.
        """
        segments: list[tuple[str | list[int], bool]] = []
        rendered = ""

        def extend(text: str, what: str) -> None:
            if not text.startswith(rendered):
                raise BadRecordError(
                    "invalid",
                    field,
                    f"the chat template's output for the first {what} is not a prefix of the next "
                    "rendering, so turns cannot be masked (does the conversation start with an "
                    "assistant message?)",
                )

        for i, message in enumerate(messages):
            if message["role"] == "assistant" and i >= train_from:
                head = self._render(messages[:i], True) if i > 0 else None
                if head is None:
                    raise BadRecordError("invalid", field, "the conversation starts with an assistant message")
                extend(head, f"{i} messages")
                segments.append((head[len(rendered) :], False))
                full = self._render(messages[: i + 1], False)
                rendered = head
                extend(full, f"{i} messages plus the generation prompt")
                body = full[len(head) :]
                end = body.rfind(self.eot)
                if end >= 0:
                    end += len(self.eot)
                    segments += [(body[:end], True), (body[end:], False)]
                else:  # a template that does not close turns with eos: close it ourselves
                    segments += [(body, True), ([self.eot_id], True)]
                rendered = full
            else:
                full = self._render(messages[: i + 1], False)
                extend(full, f"{i} messages")
                segments.append((full[len(rendered) :], False))
                rendered = full
        # Merge neighbours with one flag so the prompt is tokenised in one piece (as the
        # sampler tokenises it), then drop the untrained tail after the last response.
        merged: list[tuple[list[str | list[int]], bool]] = []
        for piece, train in segments:
            if isinstance(piece, str) and not piece:
                continue
            if merged and merged[-1][1] == train:
                merged[-1][0].append(piece)
            else:
                merged.append(([piece], train))
        while merged and not merged[-1][1]:
            merged.pop()
        if not merged:
            raise BadRecordError("empty", field, "no assistant message to train on")
        pieces = []
        for parts, train in merged:
            ids: list[int] = []
            text = ""
            for part in parts:
                if isinstance(part, str):
                    text += part
                else:
                    ids += self._ids(text) + part
                    text = ""
            ids += self._ids(text)
            pieces.append((ids, train))
        if pieces[0][1]:
            raise BadRecordError("invalid", field, "the conversation has no prompt before the first trained turn")
        prompt = pieces[0][0]
        response: list[int] = []
        mask: list[int] = []
        for ids, train in pieces[1:]:
            response += ids
            mask += [int(train)] * len(ids)
        return prompt, response, mask

    def _text_response(self, text: str) -> tuple[list[int], list[int]]:
        ids = self._ids(text)
        if not ids or ids[-1] != self.eot_id:
            ids.append(self.eot_id)
        return ids, [1] * len(ids)

    def _prompt_and_response(self, prompt: Any, response: Any, prompt_field: str, response_field: str):
        """(prompt ids, response ids, response mask) for a prompt and one response."""
        if not self.apply_chat_template and isinstance(prompt, str) and isinstance(response, str):
            if not prompt.strip():
                raise BadRecordError("empty", prompt_field, "empty text")
            if not response.strip():
                raise BadRecordError("empty", response_field, "empty text")
            return (self._ids(prompt, special=True), *self._text_response(response))
        prompt_msgs = self._with_system(self._as_messages(prompt, prompt_field, "user"))
        response_msgs = self._as_messages(response, response_field, "assistant")
        if not any(m["role"] == "assistant" and m["content"].strip() for m in response_msgs):
            raise BadRecordError("empty", response_field, "no non-empty assistant message")
        return self._conversation(prompt_msgs + response_msgs, len(prompt_msgs), response_field)

    # -------------------------------------------------------------- truncation
    def _fit(self, prompt: list[int], responses: dict[str, tuple[list[int], list[int]]], fields: Mapping[str, str]):
        """Apply the truncation policy; ``fields`` names the record field of the prompt and each response."""
        P, T = self.max_prompt_length, self.max_length
        R = min(self.max_response_length or T, T - 1)
        cut_prompt = cut_response = False
        if self.truncation == "reject":
            if len(prompt) > P:
                raise BadRecordError(
                    "too_long", fields["prompt"],
                    f"prompt has {len(prompt):,} tokens; max_prompt_length is {P:,} (data.truncation='reject')",
                )
            for name, (ids, _) in responses.items():
                if len(ids) > R or len(prompt) + len(ids) > T:
                    raise BadRecordError(
                        "too_long", fields[name],
                        f"prompt + response have {len(prompt) + len(ids):,} tokens ({len(ids):,} in the "
                        f"response); max_length is {T:,}, max response {R:,} (data.truncation='reject')",
                    )
            return prompt, responses, False, False
        if len(prompt) > P:
            prompt, cut_prompt = prompt[-P:], True
        fitted = {}
        for name, (ids, mask) in responses.items():
            if len(ids) > R:
                ids, mask, cut_response = ids[:R], mask[:R], True
            fitted[name] = (ids, mask)
        longest = max((len(ids) for ids, _ in fitted.values()), default=0)
        if len(prompt) + longest > T:
            if self.truncation == "keep_end":
                prompt, cut_prompt = prompt[len(prompt) + longest - T :], True
            else:
                room = T - len(prompt)
                for name, (ids, mask) in fitted.items():
                    if len(ids) > room:
                        fitted[name] = (ids[:room], mask[:room])
                        cut_response = True
        return prompt, fitted, cut_prompt, cut_response

    # ------------------------------------------------------------------ formats
    def encode(self, record: Mapping) -> Encoded:
        """Tokenise one record; raises :class:`BadRecordError` naming the field at fault."""
        return getattr(self, f"_encode_{self.format}")(record)

    def _encode_preference(self, record: Mapping) -> Encoded:
        chosen = self._get(record, "chosen")
        rejected = self._get(record, "rejected")
        prompt = self._get(record, "prompt", required=False)
        c_field, r_field, p_field = (self.fields[k][0] for k in ("chosen", "rejected", "prompt"))
        for value, field in ((chosen, c_field), (rejected, r_field)):
            if isinstance(value, str) and not value.strip():
                raise BadRecordError("empty", field, "empty text")
            if isinstance(value, list) and not value:
                raise BadRecordError("empty", field, "empty message list")
        if chosen == rejected:
            raise BadRecordError("identical", r_field, f"identical to {c_field!r}")
        if prompt is _MISSING:
            if not (_is_messages(chosen) and _is_messages(rejected)):
                raise BadRecordError(
                    "missing_field", p_field,
                    "record has no prompt and chosen/rejected are not conversations with a shared prefix",
                )
            chosen_msgs = _check_messages(chosen, c_field)
            rejected_msgs = _check_messages(rejected, r_field)
            shared = 0
            while (
                shared < min(len(chosen_msgs), len(rejected_msgs)) and chosen_msgs[shared] == rejected_msgs[shared]
            ):
                shared += 1
            if shared == 0:
                raise BadRecordError("missing_field", p_field, "no prompt field and no shared leading messages")
            for msgs, field in ((chosen_msgs, c_field), (rejected_msgs, r_field)):
                if len(msgs) == shared:
                    raise BadRecordError("empty", field, "no messages after the prefix shared with the other side")
                if msgs[shared]["role"] != "assistant":
                    raise BadRecordError(
                        "invalid", f"{field}[{shared}]",
                        "the conversations diverge at a non-assistant message; expected the prompt to be "
                        "the shared messages and the responses to start with an assistant turn",
                    )
            prompt, chosen, rejected = chosen_msgs[:shared], chosen_msgs[shared:], rejected_msgs[shared:]
        p_c, c_ids, c_mask = self._prompt_and_response(prompt, chosen, p_field, c_field)
        p_r, r_ids, r_mask = self._prompt_and_response(prompt, rejected, p_field, r_field)
        if p_c != p_r:
            raise BadRecordError("invalid", p_field, "the prompt tokenises differently before chosen and rejected")
        if c_ids == r_ids:
            raise BadRecordError("identical", r_field, f"tokenises identically to {c_field!r}")
        margin = self._margin(record)
        prompt_ids, fitted, cut_p, cut_r = self._fit(
            p_c,
            {"chosen": (c_ids, c_mask), "rejected": (r_ids, r_mask)},
            {"prompt": p_field, "chosen": c_field, "rejected": r_field},
        )
        return Encoded(prompt_ids, fitted, margin=margin, truncated_prompt=cut_p, truncated_response=cut_r,
                       full_prompt=p_c if cut_p else None)

    def _margin(self, record: Mapping) -> float | None:
        """The pair's ``margin``: a finite number, or ``None`` when absent (or null)."""
        field = next((k for k in self.fields["margin"] if k in record), self.fields["margin"][0])
        value = self._get(record, "margin", required=False)
        if value is _MISSING or value is None:
            if "margin" in self.required_fields:
                raise BadRecordError("missing_field", field, "is null (margin is required here)")
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise BadRecordError("invalid", field, f"must be a finite number, got {value!r}")
        return float(value)

    def _encode_unpaired(self, record: Mapping) -> Encoded:
        prompt = self._get(record, "prompt")
        completion = self._get(record, "completion")
        label = self._get(record, "label")
        l_field = self.fields["label"][0]
        if isinstance(label, bool) or (isinstance(label, (int, float)) and label in (0, 1)):
            label = int(label)
        else:
            raise BadRecordError("invalid", l_field, f"must be true/false or 0/1, got {label!r}")
        p_ids, ids, mask = self._prompt_and_response(
            prompt, completion, self.fields["prompt"][0], self.fields["completion"][0]
        )
        prompt_ids, fitted, cut_p, cut_r = self._fit(
            p_ids,
            {"response": (ids, mask)},
            {"prompt": self.fields["prompt"][0], "response": self.fields["completion"][0]},
        )
        return Encoded(prompt_ids, fitted, label=label, truncated_prompt=cut_p, truncated_response=cut_r,
                       full_prompt=p_ids if cut_p else None)

    def _encode_sft(self, record: Mapping) -> Encoded:
        field = self.fields["messages"][0]
        value = self._get(record, "messages")
        if not _is_messages(value):
            raise BadRecordError("invalid", field, f"must be a list of messages, got {type(value).__name__}")
        messages = self._with_system(_check_messages(value, field))
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            raise BadRecordError("empty", field, "no non-empty assistant message")
        p_ids, ids, mask = self._conversation(messages, 0, field)
        prompt_ids, fitted, cut_p, cut_r = self._fit(
            p_ids, {"response": (ids, mask)}, {"prompt": field, "response": field}
        )
        return Encoded(prompt_ids, fitted, truncated_prompt=cut_p, truncated_response=cut_r,
                       full_prompt=p_ids if cut_p else None)

    def _encode_text(self, record: Mapping) -> Encoded:
        field = self.fields["text"][0]
        value = self._get(record, "text")
        if not isinstance(value, str):
            raise BadRecordError("invalid", field, f"must be a string, got {type(value).__name__}")
        if not value.strip():
            raise BadRecordError("empty", field, "empty text")
        ids = self._ids(value, special=True)
        if not ids or ids[-1] != self.eot_id:
            ids.append(self.eot_id)
        if len(ids) < 2:
            raise BadRecordError("empty", field, "fewer than 2 tokens: no token to predict from a prefix")
        limit = min(self.max_length, (self.max_response_length or self.max_length) + 1)
        cut = len(ids) > limit
        if cut:
            if self.truncation == "reject":
                raise BadRecordError(
                    "too_long", field,
                    f"text has {len(ids):,} tokens; at most min(max_length, max_response_length + 1) = "
                    f"{limit:,} fit (data.truncation='reject')",
                )
            ids = ids[:limit]
        return Encoded(ids[:1], {"response": (ids[1:], [1] * (len(ids) - 1))}, truncated_response=cut)

    def _generation_prompt(self, prompt: Any, p_field: str) -> list[int]:
        """Ids of a prompt as the sampler sees it: templated with the generation prompt
        (or, plain text with ``apply_chat_template`` off, verbatim with special tokens)."""
        if not self.apply_chat_template and isinstance(prompt, str):
            if not prompt.strip():
                raise BadRecordError("empty", p_field, "empty text")
            return self._ids(prompt, special=True)
        messages = self._with_system(self._as_messages(prompt, p_field, "user"))
        if messages[-1]["role"] == "assistant":
            raise BadRecordError("invalid", p_field, "a generation prompt cannot end with an assistant message")
        return self._ids(self._render(messages, True))

    def _encode_steps(self, record: Mapping) -> Encoded:
        """A solution in steps: the prompt as for prompt sets, the steps as the response,
        the response mask 1 on each step's end token only (the positions a PRM scores)."""
        p_field = next((k for k in self.fields["prompt"] if k in record), self.fields["prompt"][0])
        s_field, l_field = self.fields["steps"][0], self.fields["labels"][0]
        steps, labels = self._get(record, "steps"), self._get(record, "labels")
        if not isinstance(steps, list) or not steps:
            raise BadRecordError("invalid" if steps else "empty", s_field,
                                 f"must be a non-empty list of strings, got {steps!r:.60}")
        for i, step in enumerate(steps):
            if not isinstance(step, str):
                raise BadRecordError("invalid", f"{s_field}[{i}]", f"must be a string, got {type(step).__name__}")
            if not step.strip():
                raise BadRecordError("empty", f"{s_field}[{i}]", "empty step")
            if self.step_delimiter in step:
                raise BadRecordError("invalid", f"{s_field}[{i}]",
                                     f"contains the step delimiter {self.step_delimiter!r} (data.step_delimiter): "
                                     "a sampled completion would split there into other steps")
        if not isinstance(labels, list) or len(labels) != len(steps):
            got = f"{len(labels)} labels" if isinstance(labels, list) else type(labels).__name__
            raise BadRecordError("invalid", l_field, f"must be a list of one label per step ({len(steps)}); got {got}")
        values = []
        for i, label in enumerate(labels):
            ok = isinstance(label, (bool, int, float)) and (isinstance(label, bool) or 0.0 <= label <= 1.0)
            if not ok:
                raise BadRecordError("invalid", f"{l_field}[{i}]",
                                     f"must be true/false or a number in [0, 1], got {label!r}")
            values.append(float(label))
        prompt = self._generation_prompt(self._get(record, "prompt"), p_field)
        ids: list[int] = []
        mask: list[int] = []
        for i, step in enumerate(steps):
            piece = self._ids(step + self.step_delimiter) if i < len(steps) - 1 else self._ids(step) + [self.eot_id]
            ids += piece
            mask += [0] * (len(piece) - 1) + [1]
        prompt_ids, fitted, cut_p, cut_r = self._fit(prompt, {"response": (ids, mask)},
                                                     {"prompt": p_field, "response": s_field})
        kept = sum(fitted["response"][1])  # a cut response keeps the steps that end inside it
        if kept == 0:
            raise BadRecordError("too_long", s_field, "no step ends within data.max_length / max_response_length "
                                 "(nothing left to train)")
        return Encoded(prompt_ids, fitted, truncated_prompt=cut_p, truncated_response=cut_r,
                       full_prompt=prompt if cut_p else None, step_labels=values[:kept])

    def _encode_prompt(self, record: Mapping) -> Encoded:
        prompt = self._get(record, "prompt")
        p_field = next((k for k in self.fields["prompt"] if k in record), self.fields["prompt"][0])
        ids = self._generation_prompt(prompt, p_field)
        reference = dict(record)
        reference["prompt"] = prompt
        answer = self._get(record, "answer", required=False)
        if answer is not _MISSING:
            reference["answer"] = answer
        cut = False
        if len(ids) > self.max_prompt_length:
            if self.truncation == "reject":
                raise BadRecordError(
                    "too_long", p_field,
                    f"prompt has {len(ids):,} tokens; max_prompt_length is {self.max_prompt_length:,} "
                    "(data.truncation='reject')",
                )
            ids, cut = ids[-self.max_prompt_length :], True
        return Encoded(ids, {}, reference=reference, truncated_prompt=cut)

    # ------------------------------------------------------------------ arrays
    def arrays(self, encoded: Encoded) -> dict[str, Any]:
        """Fixed-shape arrays of one example (see :func:`alignax.data.pipeline` for keys)."""
        if self.format == "prompt":
            out = _left_padded(encoded.prompt, self.max_prompt_length, self.pad_id)
            out["reference"] = encoded.reference
            return out
        out = {}
        for name, (ids, mask) in encoded.responses.items():
            prefix = "" if name == "response" else f"{name}_"
            for key, value in _right_padded(encoded.prompt, ids, mask, self.max_length, self.pad_id).items():
                out[prefix + key] = value
        if len(encoded.responses) > 1:  # pairs share their prompt (packed by the trainers)
            out["prompt_length"] = np.int32(len(encoded.prompt))
        if self.format == "preference":
            out["margin"] = np.float32(0.0 if encoded.margin is None else encoded.margin)
        if encoded.label is not None:
            out["label"] = np.int32(encoded.label)
        if encoded.step_labels is not None:
            out["step_mask"] = out.pop("response_mask")
            labels = np.zeros((self.max_length,), np.float32)
            labels[np.flatnonzero(out["step_mask"])] = encoded.step_labels
            out["step_labels"] = labels
        return out

    def mismatched(self, encoded: Encoded, other: Encoded) -> dict[str, np.ndarray]:
        """KTO's mismatched pair of one example: its prompt with ``other``'s completion.

        Ethayarajh et al. (2024) estimate the reference point ``KL(pi || pi_ref)`` on
        completions that do not answer their prompt. The pipeline picks ``other`` from the
        record alone (:meth:`alignax.data.PreparedData.kl_partner`), never from the batch,
        so a record's row is the same in every batch, epoch, process count, and in the
        pass that precomputes reference log-probs. Returns ``kl_tokens``,
        ``kl_positions``, ``kl_attention_mask``, ``kl_response_mask`` ``[T]``, dropping
        prompt tokens from the start if the pair is over ``max_length``.
        """
        prompt = encoded.prompt
        ids, mask = other.responses["response"]
        prompt = prompt[max(0, len(prompt) + len(ids) - self.max_length) :]
        row = _right_padded(prompt, ids, mask, self.max_length, self.pad_id)
        return {f"kl_{key}": value for key, value in row.items()}


def _right_padded(prompt: Sequence[int], response: Sequence[int], mask: Sequence[int], length: int, pad_id: int):
    n = len(prompt) + len(response)
    tokens = np.full((length,), pad_id, np.int32)
    tokens[:n] = np.asarray(list(prompt) + list(response), np.int32)
    attention = np.zeros((length,), np.int32)
    attention[:n] = 1
    response_mask = np.zeros((length,), np.int32)
    response_mask[len(prompt) : n] = np.asarray(mask, np.int32)
    positions = np.zeros((length,), np.int32)
    positions[:n] = np.arange(n, dtype=np.int32)
    return {"tokens": tokens, "positions": positions, "attention_mask": attention, "response_mask": response_mask}


def _left_padded(prompt: Sequence[int], length: int, pad_id: int):
    n = len(prompt)
    tokens = np.full((length,), pad_id, np.int32)
    tokens[length - n :] = np.asarray(prompt, np.int32)
    attention = np.zeros((length,), np.int32)
    attention[length - n :] = 1
    positions = np.zeros((length,), np.int32)
    positions[length - n :] = np.arange(n, dtype=np.int32)
    return {"prompt_tokens": tokens, "prompt_positions": positions, "prompt_attention_mask": attention}
