//! `docwarden doctor`'s warnings against the shared test server (a one-member replica
//! set): `w=1` in the URI is flagged, the default write concern is not.

use std::process::Command;

use docwarden_testkit::TestDb;

fn doctor_json(uri: &str) -> anyhow::Result<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_docwarden"))
        .args(["doctor", "--json", "--uri", uri])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "doctor failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn codes(report: &serde_json::Value) -> Vec<String> {
    report["warnings"]
        .as_array()
        .map(|ws| {
            ws.iter()
                .filter_map(|w| w["code"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// `uri` with `option` appended to its query string.
fn with_option(uri: &str, option: &str) -> String {
    if uri.contains('?') {
        format!("{uri}&{option}")
    } else if uri.trim_end_matches('/').matches('/').count() > 2 {
        format!("{uri}?{option}")
    } else {
        format!("{}/?{option}", uri.trim_end_matches('/'))
    }
}

#[tokio::test]
async fn doctor_warns_about_w1_and_retry_writes_off_on_a_replica_set() -> anyhow::Result<()> {
    let t = TestDb::new("doctor_warns_w1").await?;
    let report = doctor_json(&with_option(t.uri(), "w=1&retryWrites=false"))?;
    let topology = report["topology"].as_str().unwrap_or_default().to_owned();
    if !topology.starts_with("replica set") && !topology.starts_with("sharded") {
        docwarden_testkit::skip(
            "doctor_warns_about_w1_and_retry_writes_off_on_a_replica_set",
            &format!("the server is {topology}; the w: 1 warning is for replicated ones"),
        );
        return Ok(());
    }
    assert_eq!(report["effective_write_concern"], "1", "{report}");
    assert_eq!(report["write_concern_source"], "uri", "{report}");
    assert_eq!(
        codes(&report),
        ["write-concern-w1", "retry-writes-off"],
        "{report}"
    );
    let plain = doctor_json(&with_option(t.uri(), "w=majority"))?;
    assert!(
        !codes(&plain).iter().any(|c| c == "write-concern-w1"),
        "majority is not warned about: {plain}"
    );
    Ok(())
}
