//! Tests of tool calls: validation, rendering, the grammar's shape, and
//! reading calls back out of text, whole or streamed.

use super::*;

fn weather() -> Tool {
    Tool {
        name: "weather".into(),
        description: Some("today's weather".into()),
        parameters: Some(r#"{"type":"object","properties":{"city":{"type":"string"}}}"#.into()),
    }
}

fn params(tools: Vec<Tool>, choice: Option<ToolChoice>) -> Params {
    Params {
        tools,
        tool_choice: choice,
        ..Params::defaults()
    }
}

fn invalid_message(p: &Params) -> String {
    match Tools::from_params(p) {
        Err(AiError::InvalidInput(m)) => m,
        other => panic!("expected invalid input, got {other:?}"),
    }
}

#[test]
fn bad_tools_and_choices_are_refused_saying_why() {
    let named = |n: &str| Some(ToolChoice::Function(n.into()));
    assert!(invalid_message(&params(vec![], Some(ToolChoice::Required))).contains("no tools"));
    assert!(invalid_message(&params(vec![weather()], named("rain"))).contains("`rain`"));
    let mut bad = weather();
    bad.name = "no spaces".into();
    assert!(invalid_message(&params(vec![bad], None)).contains("not valid"));
    assert!(invalid_message(&params(vec![weather(), weather()], None)).contains("twice"));
    let mut bad = weather();
    bad.parameters = Some("[1]".into());
    assert!(invalid_message(&params(vec![bad], None)).contains("JSON schema object"));
    let mut both = params(vec![weather()], None);
    both.format = Some(kiln_runtime::OutputFormat::JsonObject);
    assert!(invalid_message(&both).contains("output format"));
    // Nothing to call: no tools, or a choice of none.
    assert!(Tools::from_params(&params(vec![], None)).unwrap().is_none());
    let none = params(vec![weather()], Some(ToolChoice::None));
    assert!(Tools::from_params(&none).unwrap().is_none());
}

#[test]
fn the_grammar_allows_text_only_in_auto_and_one_call_unless_parallel() {
    let mut p = params(vec![weather()], None);
    let auto = Tools::from_params(&p).unwrap().unwrap().grammar();
    assert!(auto.starts_with("start: TEXT | calls"), "{auto}");
    assert!(auto.contains(r#""const":"weather""#), "{auto}");
    p.tool_choice = Some(ToolChoice::Required);
    p.parallel_tool_calls = Some(false);
    let one = Tools::from_params(&p).unwrap().unwrap().grammar();
    assert!(one.starts_with("start: calls\ncalls: call\n"), "{one}");
}

#[test]
fn calls_are_read_out_of_text_and_the_rest_is_content() {
    let (text, calls) = parse(
        "Let me check.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
         <tool_call>\n{\"name\": \"time\"}\n</tool_call>",
    );
    assert_eq!(text, "Let me check.");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].name, "weather");
    assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
    assert_eq!(calls[1].arguments, "{}");
    assert!(calls[0].id.starts_with("call_") && calls[0].id != calls[1].id);
    // Not JSON, or no closing tag: text.
    let (text, calls) = parse("<tool_call>nope</tool_call> and <tool_call>{");
    assert!(calls.is_empty());
    assert_eq!(text, "<tool_call>nope</tool_call> and <tool_call>{");
}

#[test]
fn a_streamed_reply_holds_text_only_while_it_may_be_a_call() {
    let mut f = CallFilter::default();
    assert_eq!(f.push("\n<tool"), "");
    assert_eq!(f.push("_call>\n{\"name\": \"weather\", "), "");
    assert_eq!(f.push("\"arguments\": {}}\n</tool_call>"), "");
    let (rest, calls) = f.finish();
    assert_eq!((rest.as_str(), calls.len()), ("", 1));
    let mut f = CallFilter::default();
    assert_eq!(f.push("<"), "");
    assert_eq!(f.push("b>hello"), "<b>hello");
    assert_eq!(f.push(" world"), " world");
    assert_eq!(f.finish(), (String::new(), vec![]));
}

#[test]
fn templates_without_tools_get_them_in_the_system_message_and_calls_as_text() {
    let p = params(vec![weather()], None);
    let tools = Tools::from_params(&p).unwrap().unwrap();
    let call = ToolCall {
        id: "call_1".into(),
        name: "weather".into(),
        arguments: r#"{"city":"Paris"}"#.into(),
    };
    let mut asked = Message::text(Role::Assistant, "");
    asked.tool_calls = vec![call];
    let mut answer = Message::text(Role::Tool, "sunny");
    answer.tool_call_id = Some("call_1".into());
    let history = vec![Message::text(Role::User, "weather?"), asked, answer];
    let (m, listed) = chat_messages(history.clone(), Some(&tools), false);
    assert!(listed.is_none());
    assert_eq!(m[0].role, "system");
    assert!(m[0].content.contains("<tools>") && m[0].content.contains("\"weather\""));
    assert!(
        m[2].content.starts_with("<tool_call>\n{"),
        "{}",
        m[2].content
    );
    assert!(m[2].content.contains(r#""city":"Paris""#));
    assert_eq!(m[3].role, "user");
    assert_eq!(m[3].content, "<tool_response>\nsunny\n</tool_response>");
    // A template that knows tools gets them as they are.
    let (m, listed) = chat_messages(history, Some(&tools), true);
    assert_eq!(listed.unwrap()[0]["function"]["name"], "weather");
    assert_eq!(m.len(), 3);
    assert_eq!(m[1].tool_calls[0]["function"]["arguments"]["city"], "Paris");
    assert_eq!(
        (m[2].role.as_str(), m[2].tool_call_id.as_deref()),
        ("tool", Some("call_1"))
    );
}
