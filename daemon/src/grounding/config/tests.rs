use super::*;

fn load(text: &str) -> Result<GroundingConfig, SectionError> {
    let mut table: toml::Table = toml::from_str(text).expect("test input");
    GroundingConfig::load(table.remove("grounding"))
}

#[test]
fn absent_is_the_defaults() {
    let c = load("").expect("defaults");
    assert_eq!(c, GroundingConfig::default());
    assert_eq!(c.max_rounds, 2);
    assert_eq!(
        c.order_computable,
        [ArmKind::Memory, ArmKind::Tool, ArmKind::Web]
    );
    assert_eq!(
        c.order_other,
        [ArmKind::Memory, ArmKind::Web, ArmKind::Tool]
    );
    assert!(c.tool.evaluator);
    assert_eq!(
        (c.memory.dir, c.web.endpoint),
        (None, None),
        "memory and web off"
    );
}

#[test]
fn a_full_section_reads() {
    let dir = std::env::temp_dir();
    let text = format!(
        "[grounding]\nmax_rounds = 3\nround_deadline_ms = 900\narm_deadline_ms = 300\n\
         order_computable = [\"tool\", \"memory\"]\norder_other = [\"web\"]\n\
         [grounding.memory]\ndir = {:?}\nfloor = 0.5\nmax_results = 2\n\
         [grounding.tool]\nevaluator = false\n\
         [grounding.tool.http.status]\nurl = \"http://127.0.0.1:9/s\"\nmethod = \"POST\"\npattern = \"(?i)status\"\n\
         [grounding.web]\nendpoint = \"http://searx.local:8888\"\nmax_results = 5\n",
        dir.display().to_string()
    );
    let c = load(&text).expect("valid");
    assert_eq!(c.max_rounds, 3);
    assert_eq!(c.arm_deadline(), Duration::from_millis(300));
    assert_eq!(c.round_deadline(), Duration::from_millis(900));
    assert_eq!(c.order_computable, [ArmKind::Tool, ArmKind::Memory]);
    assert_eq!(c.memory.dir.as_deref(), Some(dir.as_path()));
    assert!(!c.tool.evaluator);
    assert_eq!(c.tool.http["status"].method, HttpMethod::Post);
    assert_eq!(c.web.endpoint.as_deref(), Some("http://searx.local:8888"));
}

fn assert_refused(cases: &[(&str, &str, &str)]) {
    for &(text, key, says) in cases {
        let e = load(text).expect_err(text);
        assert_eq!(e.key, key, "{text}: {e}");
        assert!(e.reason.contains(says), "{text}: {e}");
    }
}

#[test]
fn bad_round_values_name_their_key() {
    assert_refused(&[
        (
            "[grounding]\nmax_rounds = 0\n",
            "grounding.max_rounds",
            "not in 1..=10",
        ),
        (
            "[grounding]\nmax_rounds = 11\n",
            "grounding.max_rounds",
            "not in 1..=10",
        ),
        (
            "[grounding]\nround_deadline_ms = 0\n",
            "grounding.round_deadline_ms",
            "not in",
        ),
        (
            "[grounding]\nround_deadline_ms = 60000\n",
            "grounding.round_deadline_ms",
            "30000",
        ),
        (
            "[grounding]\nround_deadline_ms = 500\narm_deadline_ms = 600\n",
            "grounding.arm_deadline_ms",
            "round_deadline_ms (500)",
        ),
        (
            "[grounding]\norder_other = []\n",
            "grounding.order_other",
            "names no arm",
        ),
        (
            "[grounding]\norder_computable = [\"tool\", \"tool\"]\n",
            "grounding.order_computable",
            "twice",
        ),
        (
            "[grounding]\norder_other = [\"disk\"]\n",
            "grounding",
            "unknown variant `disk`",
        ),
        (
            "[grounding]\nmax_round = 2\n",
            "grounding",
            "unknown field `max_round`",
        ),
        ("grounding = 3\n", "grounding", "must be a table"),
    ]);
}

#[test]
fn bad_arm_values_name_their_key() {
    assert_refused(&[
        (
            "[grounding.memory]\nfloor = -1.0\n",
            "grounding.memory.floor",
            ">= 0",
        ),
        (
            "[grounding.memory]\nfloor = nan\n",
            "grounding.memory.floor",
            "finite",
        ),
        (
            "[grounding.memory]\nmax_results = 0\n",
            "grounding.memory.max_results",
            "not in 1..=20",
        ),
        (
            "[grounding.memory]\ndir = \"/nonexistent/haltd-grounding\"\n",
            "grounding.memory.dir",
            "/nonexistent/haltd-grounding: not a directory",
        ),
        (
            "[grounding.web]\nendpoint = \"https://searx.example\"\n",
            "grounding.web.endpoint",
            "https is not supported",
        ),
        (
            "[grounding.web]\nendpoint = \"searx:8888\"\n",
            "grounding.web.endpoint",
            "not an http:// URL",
        ),
        (
            "[grounding.web]\nendpoint = \"http:///search\"\n",
            "grounding.web.endpoint",
            "with a host",
        ),
        (
            "[grounding.web]\nmax_results = 21\n",
            "grounding.web.max_results",
            "not in 1..=20",
        ),
        (
            "[grounding.tool.http.s]\nurl = \"http://127.0.0.1:9\"\npattern = \"(\"\n",
            "grounding.tool.http.s.pattern",
            "\"(\"",
        ),
        (
            "[grounding.tool.http.s]\nurl = \"http://127.0.0.1:9\"\npattern = \"\"\n",
            "grounding.tool.http.s.pattern",
            "is empty",
        ),
        (
            "[grounding.tool.http.s]\nurl = \"ftp://h\"\npattern = \"x\"\n",
            "grounding.tool.http.s.url",
            "not an http:// URL",
        ),
        (
            "[grounding.tool.http.\"a b\"]\nurl = \"http://h\"\npattern = \"x\"\n",
            "grounding.tool.http.\"a b\"",
            "letters, digits",
        ),
        (
            "[grounding.tool.http.s]\nurl = \"http://h\"\npattern = \"x\"\nmethod = \"PUT\"\n",
            "grounding",
            "unknown variant `PUT`",
        ),
        (
            "[grounding.tool.http.s]\nurl = \"http://h\"\n",
            "grounding",
            "missing field `pattern`",
        ),
    ]);
}
