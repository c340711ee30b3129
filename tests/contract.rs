//! The translation contract, generated from the translators themselves: docs/translation.md
//! is checked against it.
//!
//! For each kind of message, a sample envelope with every field it can carry is shown to
//! each registered protocol's translation (`Translation::preview`). Where a field lands is
//! found by changing just that field and seeing which parts of the frame change, so the
//! tables cannot claim a mapping the code does not make. docs/translation.md embeds
//! `render()`; a test fails when the two differ (`AGENTBRIDGE_BLESS=1 cargo test --test
//! contract` rewrites it).

use std::collections::BTreeSet;
use std::fmt::Write;

use serde_json::{Value, json};

use agentbridge::core::{Attachment, Audience, Envelope, Kind, Priority, TaskInfo, TaskState};
use agentbridge::protocols::endpoint::Described;
use agentbridge::protocols::registry;

/// Every registered protocol's translation: the contract's columns.
fn columns() -> Vec<&'static dyn Described> {
    registry::translations()
}

/// A column's heading: its protocol's name, capitalised.
fn heading(column: &dyn Described) -> String {
    let name = column.protocol();
    let mut chars = name.chars();
    chars
        .next()
        .map(|first| first.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// The kinds the contract documents, each with its sample's title.
const KINDS: [(Kind, &str); 18] = [
    (Kind::Chat, "Chat"),
    (Kind::TaskAssign, "Task assigned"),
    (Kind::TaskUpdate, "Task progress"),
    (Kind::TaskResult, "Task result"),
    (Kind::PresenceJoin, "Presence: online"),
    (Kind::PresenceLeave, "Presence: offline"),
    (Kind::PresenceStatus, "Presence: busy / idle"),
    (Kind::ControlInterrupt, "Control: interrupt"),
    (Kind::ControlAbort, "Control: abort"),
    (Kind::ControlForget, "Control: forget"),
    (Kind::DecisionRequest, "Human decision: request"),
    (Kind::DecisionResponse, "Human decision: response"),
    (Kind::VoteInitiate, "Vote: initiate"),
    (Kind::VoteSubmit, "Vote: submit"),
    (Kind::VoteResult, "Vote: result"),
    (Kind::Error, "Error"),
    (Kind::Log, "Log"),
    (Kind::Context, "Context"),
];

/// A message of `kind` with every field such a message carries set.
fn sample(kind: Kind) -> Envelope {
    let mut env = Envelope::new("contract", "alice", kind);
    env.id = "msg-7".into();
    env.timestamp = 1_767_225_600_123;
    let task = |state: Option<TaskState>| TaskInfo {
        id: "task-3".into(),
        state,
        ..Default::default()
    };
    match kind {
        Kind::Chat => {
            env.to = vec!["bob".into()];
            env.mentions = vec!["carol".into()];
            env.reply_to = Some("msg-6".into());
            env.correlation_id = Some("conv-5".into());
            env.thread = Some("room-4".into());
            env.text = Some("Text of the message".into());
            env.attachments = vec![Attachment {
                name: "notes.txt".into(),
                mime_type: "text/plain".into(),
                size: 2,
                data: "aGk=".into(),
            }];
            env.priority = Priority::High;
            env.ttl_secs = Some(77);
        }
        Kind::TaskAssign => {
            env.to = vec!["bob".into()];
            env.correlation_id = Some("conv-5".into());
            env.text = Some("Text of the message".into());
            env.data = Some(json!({ "repo": "demo" }));
            env.priority = Priority::High;
            env.task = Some(Box::new(TaskInfo {
                title: Some("Task title".into()),
                description: Some("Task description".into()),
                assignee: Some("bob".into()),
                files: vec!["src/lib.rs".into()],
                external_id: Some("ext-7".into()),
                ..task(Some(TaskState::Assigned))
            }));
        }
        Kind::TaskUpdate => {
            env.to = vec!["bob".into()];
            env.reply_to = Some("msg-6".into());
            env.correlation_id = Some("conv-5".into());
            env.text = Some("Text of the message".into());
            env.task = Some(Box::new(TaskInfo {
                progress: Some(40),
                ..task(Some(TaskState::Working))
            }));
        }
        Kind::TaskResult => {
            env.to = vec!["bob".into()];
            env.reply_to = Some("msg-6".into());
            env.correlation_id = Some("conv-5".into());
            env.data = Some(json!({ "tests": "passed" }));
            env.task = Some(Box::new(TaskInfo {
                summary: Some("Task summary".into()),
                files: vec!["src/lib.rs".into()],
                ..task(Some(TaskState::Completed))
            }));
        }
        Kind::PresenceJoin | Kind::PresenceLeave => env.audience = Audience::Everyone,
        Kind::PresenceStatus => {
            env.audience = Audience::Everyone;
            env.data = Some(json!({ "status": "busy" }));
        }
        Kind::ControlInterrupt | Kind::ControlAbort | Kind::ControlForget => {
            env.to = vec!["bob".into()];
            env.text = Some("Text of the message".into());
            env.task = Some(Box::new(task(None)));
        }
        Kind::DecisionRequest | Kind::Error => {
            env.to = vec!["bob".into()];
            env.reply_to = Some("msg-6".into());
            env.correlation_id = Some("conv-5".into());
            env.text = Some("Text of the message".into());
        }
        Kind::DecisionResponse | Kind::VoteSubmit => {
            env.to = vec!["bob".into()];
            env.reply_to = Some("msg-6".into());
            env.text = Some("Text of the message".into());
        }
        Kind::VoteInitiate | Kind::VoteResult => {
            env.audience = Audience::Group("group-2".into());
            env.correlation_id = Some("conv-5".into());
            env.text = Some("Text of the message".into());
        }
        Kind::Log | Kind::Context => {
            env.text = Some("Text of the message".into());
            env.data = Some(json!({ "step": 1 }));
        }
        _ => {}
    }
    env
}

/// An envelope field, and how to change it to see where it lands.
struct Field {
    name: &'static str,
    is_set: fn(&Envelope) -> bool,
    change: fn(&mut Envelope),
}

fn task_mut(env: &mut Envelope) -> &mut TaskInfo {
    env.task.get_or_insert_default()
}

fn task_has(env: &Envelope, has: fn(&TaskInfo) -> bool) -> bool {
    env.task.as_deref().is_some_and(has)
}

const FIELDS: [Field; 22] = [
    Field {
        name: "id",
        is_set: |_| true,
        change: |e| e.id = "msg-8".into(),
    },
    Field {
        name: "from",
        is_set: |_| true,
        change: |e| e.from = "erin".into(),
    },
    Field {
        name: "to",
        is_set: |e| !e.to.is_empty(),
        change: |e| e.to = vec!["frank".into()],
    },
    Field {
        name: "mentions",
        is_set: |e| !e.mentions.is_empty(),
        change: |e| e.mentions = vec!["gina".into()],
    },
    Field {
        name: "audience",
        is_set: |e| e.audience != Audience::Addressed,
        change: |e| {
            e.audience = match e.audience {
                Audience::Group(_) => Audience::Group("group-9".into()),
                _ => Audience::Private,
            }
        },
    },
    Field {
        name: "reply_to",
        is_set: |e| e.reply_to.is_some(),
        change: |e| e.reply_to = Some("msg-9".into()),
    },
    Field {
        name: "correlation_id",
        is_set: |e| e.correlation_id.is_some(),
        change: |e| e.correlation_id = Some("conv-9".into()),
    },
    Field {
        name: "thread",
        is_set: |e| e.thread.is_some(),
        change: |e| e.thread = Some("room-9".into()),
    },
    Field {
        name: "task.id",
        is_set: |e| task_has(e, |t| !t.id.is_empty()),
        change: |e| task_mut(e).id = "task-9".into(),
    },
    Field {
        name: "task.title",
        is_set: |e| task_has(e, |t| t.title.is_some()),
        change: |e| task_mut(e).title = Some("Other title".into()),
    },
    Field {
        name: "task.description",
        is_set: |e| task_has(e, |t| t.description.is_some()),
        change: |e| task_mut(e).description = Some("Other description".into()),
    },
    Field {
        name: "task.assignee",
        is_set: |e| task_has(e, |t| t.assignee.is_some()),
        change: |e| task_mut(e).assignee = Some("hank".into()),
    },
    Field {
        name: "task.progress",
        is_set: |e| task_has(e, |t| t.progress.is_some()),
        change: |e| task_mut(e).progress = Some(41),
    },
    Field {
        name: "task.summary",
        is_set: |e| task_has(e, |t| t.summary.is_some()),
        change: |e| task_mut(e).summary = Some("Other summary".into()),
    },
    Field {
        name: "task.files",
        is_set: |e| task_has(e, |t| !t.files.is_empty()),
        change: |e| task_mut(e).files = vec!["README.md".into()],
    },
    Field {
        name: "task.external_id",
        is_set: |e| task_has(e, |t| t.external_id.is_some()),
        change: |e| task_mut(e).external_id = Some("ext-8".into()),
    },
    Field {
        name: "text",
        is_set: |e| e.text.is_some(),
        change: |e| e.text = Some("Other text".into()),
    },
    Field {
        name: "data",
        is_set: |e| e.data.is_some(),
        change: |e| e.data = Some(json!({ "other": true })),
    },
    Field {
        name: "attachments",
        is_set: |e| !e.attachments.is_empty(),
        change: |e| e.attachments[0].name = "other.txt".into(),
    },
    Field {
        name: "timestamp",
        is_set: |_| true,
        change: |e| e.timestamp += 1_001,
    },
    Field {
        name: "priority",
        is_set: |e| e.priority != Priority::Normal,
        change: |e| e.priority = Priority::Low,
    },
    Field {
        name: "ttl_secs",
        is_set: |e| e.ttl_secs.is_some(),
        change: |e| e.ttl_secs = Some(78),
    },
];

/// Where `field` of `env` shows in a protocol's frames: the paths that change with it.
fn landing(column: &dyn Described, env: &Envelope, field: &Field) -> BTreeSet<String> {
    let before = column.preview(env);
    let mut changed_env = env.clone();
    (field.change)(&mut changed_env);
    let after = column.preview(&changed_env);
    let mut paths = BTreeSet::new();
    for i in 0..before.len().max(after.len()) {
        let (b, a) = (before.get(i), after.get(i));
        let prefix = match (b, a, before.len() > 1) {
            (Some(f), _, true) | (None, Some(f), true) => {
                format!("{}: ", f.label.trim_matches('`'))
            }
            _ => String::new(),
        };
        let null = Value::Null;
        diff(
            b.map_or(&null, |f| &f.body),
            a.map_or(&null, |f| &f.body),
            &mut String::new(),
            &mut |path| {
                paths.insert(format!("{prefix}{path}"));
            },
        );
    }
    paths
}

/// Calls `found` with the path of every leaf that differs between `a` and `b`.
fn diff(a: &Value, b: &Value, path: &mut String, found: &mut dyn FnMut(&str)) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for key in keys {
                let len = path.len();
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key);
                diff(
                    x.get(key).unwrap_or(&Value::Null),
                    y.get(key).unwrap_or(&Value::Null),
                    path,
                    found,
                );
                path.truncate(len);
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (x, y)) in x.iter().zip(y).enumerate() {
                let len = path.len();
                let _ = write!(path, "[{i}]");
                diff(x, y, path, found);
                path.truncate(len);
            }
        }
        _ if a != b => found(if path.is_empty() { "(the frame)" } else { path }),
        _ => {}
    }
}

/// The generated part of docs/translation.md.
fn render() -> String {
    let mut out = String::new();
    let header = |out: &mut String, first: &str| {
        let names: Vec<String> = columns().into_iter().map(heading).collect();
        let _ = writeln!(out, "| {first} | {} |", names.join(" | "));
        let _ = writeln!(out, "|---|{}", "---|".repeat(names.len()));
    };
    for (kind, title) in KINDS {
        let env = sample(kind);
        let _ = writeln!(out, "### {title} (`{}`)\n", kind.as_str());
        header(&mut out, "Envelope");
        let shown: Vec<String> = columns()
            .iter()
            .map(|c| {
                let labels: Vec<String> = c.preview(&env).into_iter().map(|f| f.label).collect();
                if labels.is_empty() {
                    "not shown".into()
                } else {
                    labels.join(", ")
                }
            })
            .collect();
        let _ = writeln!(out, "| *shown as* | {} |", shown.join(" | "));
        for field in FIELDS.iter().filter(|f| (f.is_set)(&env)) {
            let cells: Vec<String> = columns()
                .into_iter()
                .map(|c| {
                    if c.preview(&env).is_empty() {
                        return String::new();
                    }
                    let paths = landing(c, &env, field);
                    if paths.is_empty() {
                        "— *lost*".into()
                    } else {
                        let paths: Vec<String> = paths.iter().map(|p| format!("`{p}`")).collect();
                        paths.join(", ")
                    }
                })
                .collect();
            let _ = writeln!(out, "| {} | {} |", field.name, cells.join(" | "));
        }
        out.push('\n');
    }
    let _ = writeln!(out, "### Task states\n");
    header(&mut out, "Canonical state");
    for state in [
        TaskState::Submitted,
        TaskState::Assigned,
        TaskState::Working,
        TaskState::Waiting,
        TaskState::InReview,
        TaskState::Completed,
        TaskState::Failed,
        TaskState::Cancelled,
        TaskState::Rejected,
    ] {
        let name = state_name(state);
        let cells: Vec<String> = columns()
            .iter()
            .map(|c| {
                let (shown, back) = c.task_state(state);
                match back {
                    Some(back) if back == state => shown,
                    Some(back) => format!("{shown} (reads back as {})", state_name(back)),
                    None => shown,
                }
            })
            .collect();
        let _ = writeln!(out, "| {name} | {} |", cells.join(" | "));
    }
    out
}

fn state_name(state: TaskState) -> String {
    serde_json::to_value(state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

const BEGIN: &str = "<!-- contract:begin (generated by tests/contract.rs) -->\n";
const END: &str = "<!-- contract:end -->";

#[test]
fn docs_translation_md_matches_the_code() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/translation.md");
    let doc = std::fs::read_to_string(path).expect("docs/translation.md exists");
    let (head, rest) = doc.split_once(BEGIN).expect("the doc has the begin marker");
    let (_, tail) = rest.split_once(END).expect("the doc has the end marker");
    let generated = render();
    let expected = format!("{head}{BEGIN}\n{generated}\n{END}{tail}");
    if doc == expected {
        return;
    }
    if std::env::var_os("AGENTBRIDGE_BLESS").is_some() {
        std::fs::write(path, expected).expect("docs/translation.md is writable");
        return;
    }
    panic!(
        "docs/translation.md is out of date with the translators; \
         run `AGENTBRIDGE_BLESS=1 cargo test --test contract` and review the diff"
    );
}

#[test]
fn every_sample_is_shown_somewhere() {
    for (kind, _) in KINDS {
        let env = sample(kind);
        assert!(
            columns().iter().any(|c| !c.preview(&env).is_empty()),
            "{kind:?} is shown by no protocol"
        );
    }
}

#[test]
fn the_id_reaches_every_protocol_that_shows_a_message() {
    let id = FIELDS.iter().find(|f| f.name == "id").unwrap();
    for (kind, _) in KINDS {
        let env = sample(kind);
        if kind.is_presence() {
            continue;
        }
        for column in columns() {
            if column.preview(&env).is_empty() || column.protocol() == "tracker" {
                continue;
            }
            assert!(
                !landing(column, &env, id).is_empty(),
                "{} loses the id of {kind:?}",
                heading(column)
            );
        }
    }
}
