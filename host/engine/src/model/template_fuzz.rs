//! Chat templates from model files against arbitrary templates and
//! messages: a prompt or an error, never a panic.

use super::*;
use proptest::prelude::*;

/// Pieces of the templates model files ship, and of broken ones.
const PIECES: &[&str] = &[
    "{% for message in messages %}",
    "{% endfor %}",
    "{% if message['role'] == 'system' %}",
    "{% elif loop.first %}",
    "{% else %}",
    "{% endif %}",
    "{{ message['content'] }}",
    "{{ message.content | trim }}",
    "{{ bos_token }}",
    "{{ eos_token }}",
    "{{ '<|im_start|>' + message['role'] + '\\n' }}",
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{{ raise_exception('Conversation roles must alternate') }}",
    "{{ messages[0]['content'][:10] }}",
    "{{ messages[-1].role | upper }}",
    "{% set ns = namespace(x=0) %}{% set ns.x = ns.x + 1 %}",
    "{{ message.content.strip().split('\\n')[0] }}",
    "{{ undefined_thing.attr }}",
    "{{ 1 / 0 }}",
    "{{ range(3) | list }}",
    "{% for i in range(100000000) %}",
    "{{",
    "}}",
    "{%",
    "text ",
    "\n",
];

fn template() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(PIECES), 0..10).prop_map(|p| p.concat())
}

fn messages() -> impl Strategy<Value = Vec<ChatMessage>> {
    let role = prop::sample::select(vec!["system", "user", "assistant", "tool", ""]);
    prop::collection::vec((role, ".{0,16}"), 0..5).prop_map(|v| {
        v.into_iter()
            .map(|(role, content)| ChatMessage::text(role, content))
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(crate::fuzz_cases(500)))]

    #[test]
    fn any_template_renders_or_errors(template in template(), messages in messages()) {
        let tk = Tokenizer {
            template: Some(template),
            bos_text: "<s>".into(),
            eos_text: "</s>".into(),
            ..Tokenizer::bytes(256)
        };
        let _ = tk.chat_prompt(&messages);
    }
}

#[test]
fn a_template_that_runs_for_ever_runs_out_of_fuel() {
    let tk = Tokenizer {
        template: Some(
            "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}".into(),
        ),
        ..Tokenizer::bytes(256)
    };
    let e = tk.chat_prompt(&[]).unwrap_err().to_string();
    assert!(e.contains("fuel"), "{e}");
}
