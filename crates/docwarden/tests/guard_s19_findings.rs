//! Session 19 findings in the guard, each against the real server: `$const` in a raw rule,
//! a validator on a collection with a non-simple default collation, and validators that an
//! earlier docwarden installed.

#![allow(clippy::unwrap_used)] // a test may panic on a missing document

use docwarden::guard::{self, Change, GuardOptions, GuardOutcome, Guarded, Invariant};
use docwarden_testkit::TestDb;
use mongodb::Collection;
use mongodb::bson::{Document, doc};

/// Whether a write failed the collection's validator (code 121).
fn refused_by_validator<T: std::fmt::Debug>(r: &mongodb::error::Result<T>) -> bool {
    r.as_ref()
        .is_err_and(|e| docwarden::error::error_code(e) == Some(121))
}

async fn code_of(coll: &Collection<Document>, id: i32) -> anyhow::Result<String> {
    let d = coll.find_one(doc! { "_id": id }).await?.unwrap();
    Ok(d.get_str("code")?.to_owned())
}

/// `$const` is the server's own name for `$literal` (MongoDB registers both as
/// `ExpressionConstant`, `$literal` as the alias; API version 1). Session 18's operator
/// check refused it (`InvalidInput`: "not an aggregation expression operator"). Accepting
/// it is not enough: the guard rewrites every field path of a rule onto the document after
/// the change, skipping `$literal`'s contents only, so `{$const: "$code"}` was rewritten
/// into `{$const: "$code.new"}` (the two-stage pipeline) or `{$const: "$$dw_new.code"}`
/// (a rule reading `$$ROOT`): the constant changed, and the guard wrote the very value the
/// validator and the checker refuse. A `$const` holding an operator-shaped document is a
/// constant too, not operators to check.
#[tokio::test]
async fn a_const_in_a_raw_rule_is_accepted_and_stays_a_constant() -> anyhow::Result<()> {
    let t = TestDb::new("guard_s19_const").await?;
    let coll = t.db.collection::<Document>("codes");
    coll.insert_many(vec![
        doc! { "_id": 1, "code": "a" },
        doc! { "_id": 2, "code": "a" },
    ])
    .await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let field_rule = Invariant::raw(
        "code is not the placeholder",
        doc! { "$ne": ["$code", { "$const": "$code" }] },
    )?;
    let root_rule = Invariant::raw(
        "code is not the placeholder (root)",
        doc! { "$ne": ["$$ROOT.code", { "$const": "$code" }] },
    )?;
    let placeholder = Change::set("code", "$code")?;
    for (id, rule) in [(1, &field_rule), (2, &root_rule)] {
        assert_eq!(
            g.update(id, &placeholder, std::slice::from_ref(rule))
                .await?,
            GuardOutcome::Rejected {
                invariant: rule.name().to_owned()
            },
            "{}",
            rule.name()
        );
        assert_eq!(code_of(&coll, id).await?, "a", "{}", rule.name());
        assert_eq!(
            g.update(id, &Change::set("code", "b")?, std::slice::from_ref(rule))
                .await?,
            GuardOutcome::Applied
        );
    }
    // The checker and the validator read the same constant.
    coll.insert_one(doc! { "_id": 3, "code": "$code" }).await?;
    let listed = guard::violations(&coll, std::slice::from_ref(&field_rule), None).await?;
    assert_eq!(listed.len(), 1, "{listed:?}");
    coll.delete_one(doc! { "_id": 3 }).await?;
    let installed = guard::install_validator(
        &coll,
        std::slice::from_ref(&field_rule),
        &Default::default(),
    )
    .await?;
    assert!(
        matches!(installed, guard::ValidatorInstall::Installed { .. }),
        "{installed:?}"
    );
    let bypass = coll.insert_one(doc! { "_id": 4, "code": "$code" }).await;
    assert!(refused_by_validator(&bypass), "{bypass:?}");
    // A constant document is not checked for operators.
    let shaped = Invariant::raw(
        "meta is not the marker",
        doc! { "$ne": ["$meta", { "$const": { "$frobnicate": 1 } }] },
    );
    assert!(shaped.is_ok(), "{shaped:?}");
    Ok(())
}
