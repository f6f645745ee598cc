"""Drive `gturbo serve` with the official OpenAI and Anthropic Python clients
(tests/it/serve.rs; the venv comes from `scripts/venv.sh serve`).

    python3 serve_sdk.py BASE_URL MODEL MODE [SYSTEM]

MODE `france`: the capital-of-France question four ways (OpenAI and Anthropic, plain and
streamed). MODE `shared`: two questions after the long SYSTEM prompt through each API
(the second of each may reuse the first's prefix). MODE `second`: only the second
questions (for an uncached server to compare with). MODE `tools`: a conversation with
tools, an earlier call and its result through each API, plain and streamed (the OpenAI
`tools`, assistant `tool_calls` and `tool` messages; the Anthropic `tools`, `tool_use`
and `tool_result` blocks). Prints one JSON document.

The Anthropic client has no `temperature` argument (the API's current schema dropped
the sampling fields); it goes in `extra_body`, which the server reads as the API once
documented it.
"""

import json
import sys

import anthropic
import openai

QUESTION = "What is the capital of France?"
SECOND = ["What is the capital of Italy?", "What is the capital of Spain?"]


def openai_plain(client, model, messages):
    r = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=40, seed=1
    )
    details = r.usage.prompt_tokens_details
    return {
        "text": r.choices[0].message.content,
        "finish": r.choices[0].finish_reason,
        "prompt_tokens": r.usage.prompt_tokens,
        "completion_tokens": r.usage.completion_tokens,
        "cached_tokens": details.cached_tokens if details else None,
    }


def openai_stream(client, model, messages):
    text, finish, usage = "", None, None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return {
        "text": text,
        "finish": finish,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
    }


def anthropic_plain(client, model, system, question):
    kw = {"system": system} if system is not None else {}
    r = client.messages.create(
        model=model,
        max_tokens=40,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": question}],
        **kw,
    )
    return {
        "text": "".join(b.text for b in r.content if b.type == "text"),
        "finish": r.stop_reason,
        "input_tokens": r.usage.input_tokens,
        "output_tokens": r.usage.output_tokens,
        "cache_read_input_tokens": r.usage.cache_read_input_tokens,
        "cache_creation_input_tokens": r.usage.cache_creation_input_tokens,
    }


def anthropic_stream(client, model, system, question):
    kw = {"system": system} if system is not None else {}
    events = []
    with client.messages.stream(
        model=model,
        max_tokens=40,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": question}],
        **kw,
    ) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_message()
    return {
        "text": "".join(b.text for b in final.content if b.type == "text"),
        "finish": final.stop_reason,
        "input_tokens": final.usage.input_tokens,
        "output_tokens": final.usage.output_tokens,
        "cache_read_input_tokens": final.usage.cache_read_input_tokens,
        "cache_creation_input_tokens": final.usage.cache_creation_input_tokens,
        "events": events,
    }


WEATHER = {
    "name": "get_weather",
    "description": "The current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ASK = "What is the weather in Paris? Answer in one sentence."
RESULT = "Sunny, 21 degrees Celsius."


def openai_tools(client, model, stream):
    messages = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ]
    kw = dict(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=16,
        tools=[{"type": "function", "function": WEATHER}],
        tool_choice="auto",
    )
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        return {
            "text": m.content,
            "finish": r.choices[0].finish_reason,
            "calls": [c.function.name for c in m.tool_calls or []],
        }
    text, finish, calls = "", None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            calls += [t.function.name for t in c.delta.tool_calls or []]
    return {"text": text, "finish": finish, "calls": calls}


def anthropic_tools(client, model, stream):
    messages = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}],
        },
    ]
    tool = {"name": WEATHER["name"], "description": WEATHER["description"],
            "input_schema": WEATHER["parameters"]}
    kw = dict(
        model=model,
        max_tokens=16,
        extra_body={"temperature": 0},
        messages=messages,
        tools=[tool],
        tool_choice={"type": "auto"},
    )
    if not stream:
        r = client.messages.create(**kw)
    else:
        with client.messages.stream(**kw) as s:
            for _ in s:
                pass
            r = s.get_final_message()
    return {
        "text": "".join(b.text for b in r.content if b.type == "text"),
        "finish": r.stop_reason,
        "calls": [b.name for b in r.content if b.type == "tool_use"],
        "input_tokens": r.usage.input_tokens,
    }


def main():
    base, model, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    system = sys.argv[4] if len(sys.argv) > 4 else None
    oa = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    an = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    out = {}
    if mode == "france":
        msgs = [{"role": "user", "content": QUESTION}]
        out["openai"] = openai_plain(oa, model, msgs)
        out["openai_stream"] = openai_stream(oa, model, msgs)
        out["anthropic"] = anthropic_plain(an, model, None, QUESTION)
        out["anthropic_stream"] = anthropic_stream(an, model, None, QUESTION)
        # The models list names the served model.
        out["models"] = [m.id for m in oa.models.list()]
    elif mode == "tools":
        out["openai"] = openai_tools(oa, model, False)
        out["openai_stream"] = openai_tools(oa, model, True)
        out["anthropic"] = anthropic_tools(an, model, False)
        out["anthropic_stream"] = anthropic_tools(an, model, True)
        out["count"] = an.messages.count_tokens(
            model=model,
            messages=[{"role": "user", "content": ASK}],
            tools=[{"name": "get_weather", "input_schema": WEATHER["parameters"]}],
        ).input_tokens
    else:
        questions = ([QUESTION] if mode == "shared" else []) + SECOND
        for i, q in enumerate(questions):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            key = q.split()[-1].rstrip("?")
            out[f"openai {key}"] = openai_plain(oa, model, msgs)
            out[f"anthropic {key}"] = anthropic_plain(an, model, system, q)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
