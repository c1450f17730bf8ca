"""Chat-template behaviour llama-server has (issue 28 item 8), on ChatTemplate alone: the date
variables of llama.cpp's common/chat.cpp, chat_template_kwargs such as enable_thinking, null
content for templates that cannot take it, and llama.cpp's built-in "llama3" / "command-r"
formats (src/llama-chat.cpp)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from worker.engine.text.builtin_templates import resolve_template
from worker.engine.text.chat_template import ChatTemplate, template_context

CONVO = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "hi\n"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]


def test_date_variables_follow_llamacpp_formats() -> None:
    now = datetime(2026, 3, 7, 15, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    ctx = template_context({"enable_thinking": False}, now=now)
    assert ctx == {"date_string": "07 Mar 2026", "datetime": "Mar 07 2026 13:04:05 GMT", "enable_thinking": False}


def test_a_llama_33_date_line_renders_today_not_its_fallback() -> None:
    # the shape of Llama 3.3's system header: its own fallback date only when none is given
    src = ("{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
           "Today Date: {{ date_string }}|{{ datetime }}|{{ strftime_now('%d %b %Y') }}")
    before = datetime.now().strftime("%d %b %Y")
    out = ChatTemplate(src).render([{"role": "user", "content": "x"}])
    after = datetime.now().strftime("%d %b %Y")
    date, stamp, via_strftime = out.removeprefix("Today Date: ").split("|")
    assert date in (before, after) and via_strftime in (before, after) and stamp.endswith(" GMT")
    assert "26 Jul 2024" not in out


# closes the think block unless enable_thinking is true (undefined included), as SmolLM3's does
THINK = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
         "{%- if not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def test_enable_thinking_reaches_the_template() -> None:
    t = ChatTemplate(THINK)
    msgs = [{"role": "user", "content": "x"}]
    assert t.render(msgs, template_kwargs={"enable_thinking": True}).endswith("<|im_start|>assistant\n")
    assert t.render(msgs, template_kwargs={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    segs = t.render_segments(msgs, template_kwargs={"enable_thinking": True})
    assert "".join(p for p, _ in segs) == t.render(msgs, template_kwargs={"enable_thinking": True})
    # the request's variables never replace what the renderer sets itself
    assert t.render(msgs, template_kwargs={"messages": []}).count("<|im_start|>user") == 1


# the shape of Qwen3's assistant branch: reasoning_content when given, else split on </think> in content
QWEN3_LIKE = ("{%- for m in messages %}{%- if m.role == 'assistant' %}"
              "{%- if m.reasoning_content is defined and m.reasoning_content is not none %}"
              "{%- set r = m.reasoning_content %}{%- elif '</think>' in m.content %}"
              "{%- set r = m.content.split('</think>')[0] %}{%- else %}{%- set r = '' %}{%- endif %}"
              "<|im_start|>assistant\n<think>{{ r }}</think>{{ m.content }}"
              "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{%- endfor %}<|im_end|>\n"
              "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
              "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")

CALL = [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": {}}}]


def test_a_tool_call_only_turn_renders_where_the_template_needs_content() -> None:
    t = ChatTemplate(QWEN3_LIKE)
    msgs = [{"role": "user", "content": "list"}, {"role": "assistant", "content": None, "tool_calls": CALL},
            {"role": "tool", "content": "a b", "tool_call_id": "c1"}]
    assert t.requires_content
    out = t.render(msgs)
    assert "<think></think><tool_call>ls</tool_call>" in out and "<|im_start|>tool\na b" in out
    # reasoning kept in the history reaches the template
    msgs[1] = {**msgs[1], "reasoning_content": "look first"}
    assert "<think>look first</think><tool_call>ls</tool_call>" in t.render(msgs)
    assert not ChatTemplate(resolve_template("chatml")).requires_content  # it takes null content: left alone


def test_llamacpp_builtin_llama3() -> None:
    out = ChatTemplate(resolve_template("llama3")).render(CONVO)
    assert out == ("<|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\nhello<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nbye<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llamacpp_builtin_command_r() -> None:
    out = ChatTemplate(resolve_template("Command-R")).render(CONVO)
    assert out == ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>be brief<|END_OF_TURN_TOKEN|>"
                   "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>hi<|END_OF_TURN_TOKEN|>"
                   "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>hello<|END_OF_TURN_TOKEN|>"
                   "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>bye<|END_OF_TURN_TOKEN|>"
                   "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")


def test_an_empty_conversation_renders_the_generation_prompt() -> None:
    assert ChatTemplate(resolve_template("chatml")).render([]) == "<|im_start|>assistant\n"


# ------------------------------------------------------------------ post_sampling_probs (sampling.py)


def test_post_sampling_candidates_are_the_chains_distribution() -> None:
    import math

    import numpy as np

    from worker.engine.sampling import Sampler, SamplingParams
    logits = np.array([1.0, 2.0, 3.0, 4.0, 0.0, -1.0], dtype=np.float32)
    base = dict(top_k=3, top_p=1.0, min_p=0.0, temperature=0.5, seed=7, n_probs=5)
    plain = Sampler(SamplingParams(**base).validated(6), 6)
    post = Sampler(SamplingParams(**base, post_sampling_probs=True).validated(6), 6)
    tid = post.sample(logits)
    assert tid == plain.sample(logits)  # reporting changes nothing of the sampling
    ids, probs = post.last_candidates  # type: ignore[misc]
    assert ids.tolist() == [3, 2, 1]  # top-k 3
    want = np.exp(np.array([4.0, 3.0, 2.0]) / 0.5)
    assert np.allclose(probs, want / want.sum()) and math.isclose(probs.sum(), 1.0)
    lp, top = post.post_sampling(tid, 5)
    assert [i for i, _ in top] == [3, 2, 1] and math.isclose(math.exp(lp), probs[[3, 2, 1].index(tid)])
    greedy = Sampler(SamplingParams(**{**base, "temperature": 0.0}, post_sampling_probs=True).validated(6), 6)
    assert greedy.sample(logits) == 3
    lp, top = greedy.post_sampling(3, 2)
    assert lp == 0.0 and top == [(3, 0.0), (2, -math.inf)]
