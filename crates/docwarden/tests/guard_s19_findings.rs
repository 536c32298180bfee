//! Session 19 findings in the guard, each against the real server: `$const` in a raw rule,
//! a validator on a collection with a non-simple default collation, and validators that an
//! earlier docwarden installed.

#![allow(clippy::unwrap_used)] // a test may panic on a missing document

use docwarden::guard::{self, Change, Condition, GuardOptions, GuardOutcome, Guarded, Invariant};
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

/// Creates `name` with the case-insensitive default collation `{locale: "en", strength:
/// 2}`; `false` (the test reported as skipped, loudly) if the server refuses collations,
/// does not keep the collection's collation, or ignores it when comparing strings.
async fn case_insensitive(t: &TestDb, test: &str, name: &str) -> anyhow::Result<bool> {
    use mongodb::options::{Collation, CollationStrength};
    let collation = Collation::builder()
        .locale("en")
        .strength(CollationStrength::Secondary)
        .build();
    if let Err(e) = t.db.create_collection(name).collation(collation).await {
        docwarden_testkit::skip(test, &format!("the server refuses collations: {e}"));
        return Ok(false);
    }
    if docwarden::preflight::default_collation(&t.db, name)
        .await?
        .is_none()
    {
        docwarden_testkit::skip(test, "the server does not keep a collection's collation");
        return Ok(false);
    }
    let coll = t.db.collection::<Document>(name);
    coll.insert_one(doc! { "_id": "probe", "name": "Bob" })
        .await?;
    let honoured = coll.find_one(doc! { "name": "bob" }).await?.is_some();
    coll.delete_one(doc! { "_id": "probe" }).await?;
    if !honoured {
        docwarden_testkit::skip(test, "the server ignores a collection's default collation");
    }
    Ok(honoured)
}

/// MongoDB evaluates a validator with the collection's default collation
/// (`CollectionImpl::parseValidator` clones the collection's collator into the validator's
/// expression context), as it does every update and aggregation that names none; the
/// embedded server does the same. So on a collection created with `{locale: "en",
/// strength: 2}` the rule "Bob is on call" holds for a shift whose only doctor is "bob", in
/// the validator, the guarded update and the checker alike, where docwarden's rules compare
/// byte for byte everywhere else (and `Guarded::open` refuses the collection). Until
/// session 19 `install_validator` installed it there anyway; now it is
/// `Error::Incompatible` naming the collation, and nothing is installed.
#[tokio::test]
async fn a_validator_is_not_installed_on_a_collection_with_a_non_simple_collation()
-> anyhow::Result<()> {
    let test = "a_validator_is_not_installed_on_a_collection_with_a_non_simple_collation";
    let t = TestDb::new(test).await?;
    if !case_insensitive(&t, test, "shifts").await? {
        return Ok(());
    }
    let coll = t.db.collection::<Document>("shifts");
    let bob_on_call = Invariant::at_least(
        "Bob on call",
        "doctors",
        1,
        Condition::all(vec![
            Condition::eq("name", "Bob"),
            Condition::eq("on_call", true),
        ]),
    )?;
    let rule = [bob_on_call];
    // Control: the collation changes what the rule means. Byte for byte shift 2 has no Bob;
    // under the collection's collation the checker finds no violation.
    coll.insert_many(vec![
        doc! { "_id": 1, "doctors": [{ "name": "Bob", "on_call": true }] },
        doc! { "_id": 2, "doctors": [{ "name": "bob", "on_call": true }] },
    ])
    .await?;
    let listed = guard::violations(&coll, &rule, None).await?;
    assert!(listed.is_empty(), "the collation did not apply: {listed:?}");

    let installed = guard::install_validator(&coll, &rule, &Default::default()).await;
    assert!(
        matches!(&installed, Err(docwarden::Error::Incompatible { reason }) if reason.contains("collation")),
        "{installed:?}"
    );
    let options = docwarden::preflight::default_collation(&t.db, "shifts").await?;
    assert!(options.is_some());
    assert_eq!(
        t.validator_of("shifts").await?,
        None,
        "a validator was installed"
    );
    // A collection with the simple collation stated is accepted.
    t.db.create_collection("simple")
        .collation(
            mongodb::options::Collation::builder()
                .locale("simple")
                .build(),
        )
        .await?;
    let simple = t.db.collection::<Document>("simple");
    let ok = guard::install_validator(&simple, &rule, &Default::default()).await?;
    assert!(
        matches!(ok, guard::ValidatorInstall::Installed { .. }),
        "{ok:?}"
    );
    Ok(())
}

/// A validator is docwarden's only if it is byte for byte what this version would install,
/// so after an upgrade that changed a rule's rendering (session 17 added the type bracket
/// to ordering comparisons) the validator an earlier version installed was reported as
/// `OtherValidator`, someone else's, and kept: the collection went on accepting
/// `balance: "-5"`, which the fixed rule refuses, unless the caller replaced "other"
/// validators blindly (a user's `$jsonSchema` included). Since session 19 the validator
/// carries a `$comment` marker naming the invariants, and an unmarked validator that is
/// `{$expr: {$and: [...]}}` of these invariants as this or an earlier version rendered them
/// is recognised too: `install_validator` replaces it after the usual violator checks and
/// answers `Upgraded { previous }`. A hand-written validator of the same meaning is still
/// someone else's.
#[tokio::test]
async fn a_validator_installed_by_an_earlier_docwarden_is_upgraded() -> anyhow::Result<()> {
    let t = TestDb::new("guard_s19_upgrade").await?;
    let accounts = t.db.collection::<Document>("accounts");
    // As session 16 installed `balance >= 0` (and sessions 17-18 the on-call rule).
    let before_17 = doc! { "$expr": { "$and": [
        { "$gte": ["$balance", { "$literal": 0_i64 }] },
    ]}};
    t.db.run_command(doc! { "create": "accounts", "validator": before_17.clone() })
        .await?;
    accounts
        .insert_one(doc! { "_id": 1, "balance": "-5" })
        .await?;
    let rule = [Invariant::field_cmp(
        "balance never negative",
        "balance",
        docwarden::guard::CmpOp::Gte,
        0_i64,
    )?];
    // The violator the old rendering let in is found first: the old validator stays.
    let refused = guard::install_validator(&accounts, &rule, &Default::default()).await?;
    let guard::ValidatorInstall::Refused { violations } = refused else {
        panic!("{refused:?}");
    };
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert_eq!(t.validator_of("accounts").await?, Some(before_17.clone()));
    accounts.delete_one(doc! { "_id": 1 }).await?;
    let upgraded = guard::install_validator(&accounts, &rule, &Default::default()).await?;
    assert_eq!(
        upgraded,
        guard::ValidatorInstall::Upgraded {
            previous: before_17,
            existing_violations: vec![]
        }
    );
    assert_eq!(
        t.validator_of("accounts").await?,
        Some(guard::validator_document(&rule))
    );
    let string = accounts
        .insert_one(doc! { "_id": 2, "balance": "-5" })
        .await;
    assert!(refused_by_validator(&string), "{string:?}");
    accounts
        .insert_one(doc! { "_id": 3, "balance": 5_i64 })
        .await?;
    // Installed again: the same.
    let again = guard::install_validator(&accounts, &rule, &Default::default()).await?;
    assert!(
        matches!(again, guard::ValidatorInstall::Installed { .. }),
        "{again:?}"
    );

    // Sessions 17-18: the current expressions without the marker.
    let on_call = [docwarden_workloads::on_call::rule()?];
    let unmarked = doc! { "$expr": { "$and": [on_call[0].expr().clone()] } };
    t.db.run_command(doc! { "create": "shifts", "validator": unmarked.clone() })
        .await?;
    let shifts = t.db.collection::<Document>("shifts");
    let upgraded = guard::install_validator(&shifts, &on_call, &Default::default()).await?;
    assert_eq!(
        upgraded,
        guard::ValidatorInstall::Upgraded {
            previous: unmarked,
            existing_violations: vec![]
        }
    );

    // Someone else's: a hand-written rule of the same meaning, and docwarden's marker for
    // other invariants.
    let others = [
        doc! { "$expr": { "$gte": ["$balance", 0_i64] } },
        guard::validator_document(&on_call),
    ];
    for (i, other) in others.into_iter().enumerate() {
        let name = format!("other{i}");
        t.db.run_command(doc! { "create": &name, "validator": other.clone() })
            .await?;
        let coll = t.db.collection::<Document>(&name);
        let kept = guard::install_validator(&coll, &rule, &Default::default()).await?;
        assert_eq!(
            kept,
            guard::ValidatorInstall::OtherValidator {
                validator: other.clone()
            }
        );
        assert_eq!(t.validator_of(&name).await?, Some(other));
    }
    Ok(())
}

/// The API block of `docs/guard.md`, run as written against a seed-shaped shift (the
/// block's `&[on_call.clone()]` written `std::slice::from_ref(&on_call)` for clippy).
#[tokio::test]
async fn the_api_block_of_the_guard_docs_does_what_it_says() -> anyhow::Result<()> {
    use mongodb::bson::DateTime;
    let t = TestDb::new("guard_s19_docs").await?;
    let db = &t.db;
    let coll = db.collection::<Document>("shifts");
    let now = DateTime::now();
    coll.insert_one(doc! { "_id": 1, "doctors": [
        { "name": "Alice", "on_call": true, "updated": now },
        { "name": "Bob", "on_call": true, "updated": now },
    ]})
    .await?;
    let on_call = Invariant::at_least(
        "at least one doctor on call",
        "doctors",
        1,
        Condition::eq("on_call", true),
    )?;
    let shifts = Guarded::open(db, "shifts", GuardOptions::default()).await?;
    let off = Change::set_member("doctors", "name", "Bob", doc! { "on_call": false })?;
    assert_eq!(
        shifts
            .update(1, &off, std::slice::from_ref(&on_call))
            .await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        shifts
            .update(1, &off, std::slice::from_ref(&on_call))
            .await?,
        GuardOutcome::NoChange
    );
    assert_eq!(
        shifts
            .update(2, &off, std::slice::from_ref(&on_call))
            .await?,
        GuardOutcome::NotFound
    );
    let zoe = Change::set_member("doctors", "name", "Zoe", doc! { "on_call": false })?;
    assert_eq!(
        shifts
            .update(1, &zoe, std::slice::from_ref(&on_call))
            .await?,
        GuardOutcome::NoSuchMember
    );
    let alice = Change::set_member("doctors", "name", "Alice", doc! { "on_call": false })?;
    assert_eq!(
        shifts
            .update(1, &alice, std::slice::from_ref(&on_call))
            .await?,
        GuardOutcome::Rejected {
            invariant: "at least one doctor on call".into()
        }
    );
    assert!(
        guard::violations(&coll, std::slice::from_ref(&on_call), None)
            .await?
            .is_empty()
    );
    let installed = guard::install_validator(&coll, &[on_call], &Default::default()).await?;
    assert!(
        matches!(installed, guard::ValidatorInstall::Installed { .. }),
        "{installed:?}"
    );
    assert_eq!(
        guard::ensure_array_index(&coll, "doctors.updated").await?,
        "doctors.updated_1"
    );
    let t0 = DateTime::from_millis(now.timestamp_millis() - 3_600_000);
    assert_eq!(
        guard::index_use(&coll, doc! { "doctors.updated": { "$gte": t0 } }).await?,
        guard::IndexUse::IndexScan {
            index: "doctors.updated_1".into()
        }
    );
    Ok(())
}

/// `ValidatorOptions::list_limit` below 1 is documented as `InvalidInput`, but it was only
/// checked by the violations listing, after the collection's validator was read: on a
/// collection with someone else's validator the answer was `OtherValidator`, and elsewhere
/// the error named `limit`, not the option. Options are now validated before anything is
/// sent (`what: "list_limit"`), as a handle validates its options once.
#[tokio::test]
async fn a_list_limit_below_one_is_invalid_input_before_anything_is_read() -> anyhow::Result<()> {
    let t = TestDb::new("guard_s19_list_limit").await?;
    t.db.run_command(
        doc! { "create": "other", "validator": { "$jsonSchema": { "required": ["a"] } } },
    )
    .await?;
    let rule = [Invariant::field_cmp(
        "nonneg",
        "balance",
        docwarden::guard::CmpOp::Gte,
        0_i64,
    )?];
    for name in ["other", "fresh"] {
        let r = guard::install_validator(
            &t.db.collection(name),
            &rule,
            &guard::ValidatorOptions::default().list_limit(0),
        )
        .await;
        assert!(
            matches!(
                r,
                Err(docwarden::Error::InvalidInput {
                    what: "list_limit",
                    ..
                })
            ),
            "{name}: {r:?}"
        );
    }
    Ok(())
}
