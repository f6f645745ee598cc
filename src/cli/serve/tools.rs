//! Tool use for `gturbo serve`: the tool definitions go into the chat template's
//! `tools` variable (as transformers' `apply_chat_template(tools=...)` passes them),
//! and the model's answer is parsed for calls in the format the template teaches.
//!
//! A template that never reads `tools` cannot show the model its tools: the tool list
//! and the call format are then appended to the system prompt ([`appendix`]), earlier
//! calls are written into the assistant's text and tool results into user turns, in
//! the same format.
//!
//! [`FORMATS`] is the one table of call formats: a format is picked by a marker in
//! the template's source, and the Hermes format (Qwen2.5, Qwen3, Hermes; what the
//! appendix teaches) is the default.

use serde_json::{Value, json};

use crate::runtime::text::ChatMessage;

/// How a model writes a tool call in its answer.
#[derive(Debug, PartialEq, Eq)]
pub struct ToolFormat {
    /// For messages.
    pub name: &'static str,
    /// Text in a template's source that says it teaches this format.
    pub marker: &'static str,
    /// What opens a call.
    pub open: &'static str,
    /// What closes it. Between them: `{"name": …, "arguments": {…}}`.
    pub close: &'static str,
    /// What wraps a tool's result in a user turn (when the template has no tool role).
    pub result: (&'static str, &'static str),
}

/// Every call format the server parses.
pub const FORMATS: &[ToolFormat] = &[ToolFormat {
    name: "hermes",
    marker: "<tool_call>",
    open: "<tool_call>",
    close: "</tool_call>",
    result: ("<tool_response>\n", "\n</tool_response>"),
}];

/// The format `template` teaches (the first of [`FORMATS`] whose marker it holds),
/// else the default one, which [`appendix`] teaches.
pub fn format_for(template: Option<&str>) -> &'static ToolFormat {
    FORMATS
        .iter()
        .find(|f| template.is_some_and(|t| t.contains(f.marker)))
        .unwrap_or(&FORMATS[0])
}

/// Whether `template` reads the `tools` variable.
pub fn template_takes_tools(template: Option<&str>) -> bool {
    template.is_some_and(|t| t.contains("tools"))
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// A JSON object.
    pub arguments: Value,
}

/// The call `body` (the text between a format's open and close) names, if it is one:
/// a JSON object with a string `name` and an object `arguments` (or `parameters`; a
/// string holding an object is read too; none is `{}`).
pub fn parse_call(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    let arguments = match args {
        None | Some(Value::Null) => json!({}),
        Some(Value::Object(_)) => args?.clone(),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s)
            .ok()
            .filter(Value::is_object)?,
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

/// A piece of an answer: text, or a call.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

/// Splits a streamed answer into text and calls: text that may begin a call is held
/// back until it is known; a call is released whole when it closes. A call whose JSON
/// is not a call is released as the text it was.
pub struct ToolParser {
    format: &'static ToolFormat,
    held: String,
    inside: bool,
    /// A call was released and no text since: whitespace is not text yet (models put
    /// newlines between calls).
    after_call: bool,
}

impl ToolParser {
    pub fn new(format: &'static ToolFormat) -> ToolParser {
        ToolParser {
            format,
            held: String::new(),
            inside: false,
            after_call: false,
        }
    }

    /// Add `text`: the pieces now complete.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let (open, close) = (self.format.open, self.format.close);
        let mut out = Vec::new();
        loop {
            if self.inside {
                let Some(at) = self.held.find(close) else {
                    break;
                };
                let body: String = self.held.drain(..at + close.len()).collect();
                let body = &body[..at];
                out.push(match parse_call(body) {
                    Some(c) => Piece::Call(c),
                    None => Piece::Text(format!("{open}{body}{close}")),
                });
                self.inside = false;
                self.after_call = true;
                continue;
            }
            if let Some(at) = self.held.find(open) {
                let text: String = self.held.drain(..at).collect();
                self.held.drain(..open.len());
                self.text(text, &mut out);
                self.inside = true;
                continue;
            }
            // Release all but a tail that may begin `open`.
            let keep = (1..open.len().min(self.held.len() + 1))
                .rev()
                .find(|&n| {
                    self.held.is_char_boundary(self.held.len() - n)
                        && open.starts_with(&self.held[self.held.len() - n..])
                })
                .unwrap_or(0);
            let end = self.held.len() - keep;
            if self.after_call && self.held[..end].trim().is_empty() {
                break; // only whitespace since the call: not text yet
            }
            let text: String = self.held.drain(..end).collect();
            self.text(text, &mut out);
            break;
        }
        out
    }

    /// Release `text` (after a call, without its leading whitespace).
    fn text(&mut self, text: String, out: &mut Vec<Piece>) {
        let text = if self.after_call {
            text.trim_start().to_string()
        } else {
            text
        };
        if !text.is_empty() {
            self.after_call = false;
            out.push(Piece::Text(text));
        }
    }

    /// The end of the answer: what is still held (a call left open at the end is
    /// parsed as far as it went).
    pub fn finish(&mut self) -> Vec<Piece> {
        let held = std::mem::take(&mut self.held);
        if self.inside {
            self.inside = false;
            return vec![match parse_call(&held) {
                Some(c) => Piece::Call(c),
                None => Piece::Text(format!("{}{held}", self.format.open)),
            }];
        }
        let mut out = Vec::new();
        self.text(held, &mut out);
        out
    }
}

/// The system prompt's appendix for a template without tool support: the tools and
/// how to call them, in `format`.
pub fn appendix(tools: &[Value], format: &ToolFormat) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query. \
         The functions, one JSON schema a line:\n",
    );
    for t in tools {
        s.push_str(&t.to_string());
        s.push('\n');
    }
    s.push_str(&format!(
        "\nTo call a function, answer with {}{{\"name\": <function-name>, \"arguments\": \
         <args-json-object>}}{} (one per call); the results come back in {}…{}.",
        format.open,
        format.close,
        format.result.0.trim(),
        format.result.1.trim()
    ));
    s
}

/// The conversation as the template is given it, and the tools for its `tools`
/// variable: unchanged when `template` reads `tools`; else with the tools in the
/// system prompt's appendix, earlier calls written into the assistant's text and tool
/// results into user turns, in the call format.
pub fn prepare(
    template: Option<&str>,
    mut messages: Vec<ChatMessage>,
    tools: Vec<Value>,
) -> (Vec<ChatMessage>, Vec<Value>) {
    if template_takes_tools(template) {
        return (messages, tools);
    }
    let format = format_for(template);
    for m in &mut messages {
        for c in std::mem::take(&mut m.tool_calls) {
            let f = c.get("function").unwrap_or(&c);
            let call = json!({"name": f.get("name"), "arguments": f.get("arguments")});
            if !m.content.is_empty() {
                m.content.push('\n');
            }
            m.content
                .push_str(&format!("{}{call}{}", format.open, format.close));
        }
        if m.role == "tool" {
            m.role = "user".into();
            m.tool_call_id = None;
            m.content = format!("{}{}{}", format.result.0, m.content, format.result.1);
        }
    }
    if !tools.is_empty() {
        let extra = appendix(&tools, format);
        match messages.first_mut().filter(|m| m.role == "system") {
            Some(sys) => sys.content = format!("{}\n\n{extra}", sys.content),
            None => messages.insert(0, ChatMessage::new("system", extra)),
        }
    }
    (messages, Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: Value) -> Piece {
        Piece::Call(ToolCall {
            name: name.into(),
            arguments,
        })
    }

    fn text(s: &str) -> Piece {
        Piece::Text(s.into())
    }

    /// Everything `chunks` give, pushed one after another, then finished.
    fn run(chunks: &[&str]) -> Vec<Piece> {
        let mut p = ToolParser::new(&FORMATS[0]);
        let mut out: Vec<Piece> = chunks.iter().flat_map(|c| p.push(c)).collect();
        out.extend(p.finish());
        // Adjacent text pieces joined (how they were cut is the stream's business).
        let mut joined: Vec<Piece> = Vec::new();
        for piece in out {
            match (joined.last_mut(), piece) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, p) => joined.push(p),
            }
        }
        joined
    }

    #[test]
    fn hermes_calls_are_parsed_however_the_stream_cuts_them() {
        let answer = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                      {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \
                      \"arguments\": {}}\n</tool_call>";
        let want = vec![
            text("Let me look.\n"),
            call("get_weather", json!({"city": "Paris"})),
            call("now", json!({})),
        ];
        assert_eq!(run(&[answer]), want);
        // Cut at every char boundary, and one char at a time.
        for at in (0..answer.len()).filter(|&i| answer.is_char_boundary(i)) {
            assert_eq!(run(&[&answer[..at], &answer[at..]]), want, "cut at {at}");
        }
        let chars: Vec<String> = answer.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(&refs), want);
    }

    #[test]
    fn what_is_not_a_call_stays_text() {
        // No call at all; a tag-like start that is not the tag; a body that is not a
        // call; string arguments holding an object; a call cut off by the end.
        assert_eq!(
            run(&["Paris is the capital."]),
            vec![text("Paris is the capital.")]
        );
        assert_eq!(run(&["a <tool", "box> b"]), vec![text("a <toolbox> b")]);
        assert_eq!(
            run(&["<tool_call>not json</tool_call>"]),
            vec![text("<tool_call>not json</tool_call>")]
        );
        assert_eq!(
            run(&["<tool_call>{\"arguments\": {}}</tool_call>"]),
            vec![text("<tool_call>{\"arguments\": {}}</tool_call>")]
        );
        assert_eq!(
            run(&["<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>"]),
            vec![call("f", json!({"x": 1}))]
        );
        assert_eq!(
            run(&["<tool_call>{\"name\": \"f\", \"parameters\": {\"y\": [1]}}"]),
            vec![call("f", json!({"y": [1]}))]
        );
        assert_eq!(
            run(&["<tool_call>{\"name\": "]),
            vec![text("<tool_call>{\"name\": ")]
        );
        assert_eq!(run(&["é<"]), vec![text("é<")]);
        // Text after a call, without the whitespace before it.
        assert_eq!(
            run(&[
                "<tool_call>{\"name\": \"f\"}</tool_call>\n",
                "\n",
                "Done.",
                " "
            ]),
            vec![call("f", json!({})), text("Done. ")]
        );
    }

    fn qwen3_template() -> &'static str {
        include_str!("../../../tests/data/qwen3_chat/chat_template.jinja")
    }

    fn weather_tool() -> Value {
        json!({"type": "function", "function": {"name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    fn conversation() -> Vec<ChatMessage> {
        let mut asked = ChatMessage::new("assistant", "");
        asked.tool_calls = vec![json!({"type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}})];
        let mut result = ChatMessage::new("tool", "sunny, 21 C");
        result.tool_call_id = Some("call_1".into());
        vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Weather in Paris?"),
            asked,
            result,
        ]
    }

    fn render(template: &str, messages: &[ChatMessage], tools: &[Value]) -> String {
        let mut ctx = serde_json::Map::new();
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut v = json!({"role": m.role, "content": m.content});
                if !m.tool_calls.is_empty() {
                    v["tool_calls"] = Value::Array(m.tool_calls.clone());
                }
                v
            })
            .collect();
        ctx.insert("messages".into(), Value::Array(msgs));
        if !tools.is_empty() {
            ctx.insert("tools".into(), Value::Array(tools.to_vec()));
        }
        ctx.insert("add_generation_prompt".into(), Value::Bool(true));
        crate::runtime::text::render_template(template, std::path::Path::new("t.jinja"), ctx)
            .unwrap()
    }

    /// Qwen3's own template renders the tools, the earlier call and its result as
    /// Qwen3 was trained on them (the text transformers' `apply_chat_template` gives).
    #[test]
    fn qwen3s_template_gets_the_tools_the_call_and_the_result() {
        let t = qwen3_template();
        assert!(template_takes_tools(Some(t)));
        assert_eq!(format_for(Some(t)).name, "hermes");
        let (msgs, tools) = prepare(Some(t), conversation(), vec![weather_tool()]);
        assert_eq!(msgs, conversation());
        let out = render(t, &msgs, &tools);
        let want = "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more \
            functions to assist with the user query.\n\nYou are provided with function \
            signatures within <tools></tools> XML tags:\n<tools>\n\
            {\"function\": {\"description\": \"Weather of a city\", \"name\": \"get_weather\", \
            \"parameters\": {\"properties\": {\"city\": {\"type\": \"string\"}}, \"type\": \
            \"object\"}}, \"type\": \"function\"}\n</tools>\n\nFor each function call, return \
            a json object with function name and arguments within <tool_call></tool_call> XML \
            tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": \
            <args-json-object>}\n</tool_call><|im_end|>\n\
            <|im_start|>user\nWeather in Paris?<|im_end|>\n\
            <|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
            {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n\
            <|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n\
            <|im_start|>assistant\n";
        assert_eq!(out, want);
    }

    /// A template without tools (ChatML as SmolLM2's) gets them in the system prompt,
    /// the call in the assistant's text and the result in a user turn.
    #[test]
    fn a_template_without_tools_gets_them_in_the_system_prompt() {
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n\
                      {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        assert!(!template_takes_tools(Some(chatml)));
        let (msgs, tools) = prepare(Some(chatml), conversation(), vec![weather_tool()]);
        assert!(tools.is_empty());
        let out = render(chatml, &msgs, &tools);
        assert!(
            out.starts_with("<|im_start|>system\nBe brief.\n\n# Tools\n"),
            "{out}"
        );
        assert!(out.contains(&weather_tool().to_string()), "{out}");
        assert!(out.contains(
            "<|im_start|>assistant\n<tool_call>{\"arguments\":{\"city\":\"Paris\"},\"name\":\"get_weather\"}</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n\
             <|im_start|>assistant\n"
        ), "{out}");
        // No system message: one is made for the appendix.
        let (msgs, _) = prepare(
            Some(chatml),
            conversation()[1..].to_vec(),
            vec![weather_tool()],
        );
        assert_eq!(msgs[0].role, "system");
        assert!(msgs[0].content.starts_with("# Tools"));
    }
}
