//! Session 21 findings in the guard, against the real server: a validator that combines
//! the invariants with a user's `$jsonSchema`, as `docs/guard.md` recommends.

use docwarden::guard::{self, CmpOp, Invariant, ValidatorInstall, ValidatorOptions};
use docwarden_testkit::TestDb;
use mongodb::Collection;
use mongodb::bson::{Document, doc};

/// Whether a write failed the collection's validator (code 121).
fn refused_by_validator<T: std::fmt::Debug>(r: &mongodb::error::Result<T>) -> bool {
    r.as_ref()
        .is_err_and(|e| docwarden::error::error_code(e) == Some(121))
}

/// Whether the collection refuses an account without an owner (the user's `$jsonSchema`)
/// and one with a string balance (the invariant), and accepts a good one; each written
/// document is removed again.
async fn both_rules_hold(coll: &Collection<Document>) -> anyhow::Result<bool> {
    let ownerless = coll.insert_one(doc! { "_id": 1, "balance": 5_i64 }).await;
    let string = coll
        .insert_one(doc! { "_id": 2, "owner": "a", "balance": "-5" })
        .await;
    coll.insert_one(doc! { "_id": 3, "owner": "a", "balance": 5_i64 })
        .await?;
    coll.delete_many(doc! {}).await?;
    Ok(refused_by_validator(&ownerless) && refused_by_validator(&string))
}

/// `docs/guard.md` tells a user who wants their own rules next to the invariants to combine
/// them by hand, `{$and: [{$jsonSchema: …}, validator_document(invariants)]}`, and install
/// that with `collMod`. `install_validator` then answered `OtherValidator` for it, forever,
/// although the invariants were in it: a service that installs its validator at start-up
/// was told to "combine the rules into one validator", which it had done, or to replace
/// "other" validators, which drops the user's `$jsonSchema`; and a clause an earlier
/// docwarden rendered could never be upgraded. Now a top-level `$and` with exactly one
/// clause that is docwarden's for these invariants is recognised: this version's clause is
/// `Installed` (the validator kept as it is), an earlier one's is `Upgraded` in place, the
/// user's rules kept. An `$or`, which would not enforce the invariants, is still someone
/// else's.
#[tokio::test]
async fn a_validator_combining_the_invariants_with_a_json_schema_is_recognised()
-> anyhow::Result<()> {
    let t = TestDb::new("guard_s21_combined").await?;
    let rule = [Invariant::field_cmp(
        "balance never negative",
        "balance",
        CmpOp::Gte,
        0_i64,
    )?];
    let schema = doc! { "$jsonSchema": { "required": ["owner"] } };
    let combined = doc! { "$and": [schema.clone(), guard::validator_document(&rule)] };
    t.db.run_command(doc! { "create": "accounts", "validator": combined.clone() })
        .await?;
    let accounts = t.db.collection::<Document>("accounts");
    assert!(both_rules_hold(&accounts).await?);
    let installed =
        guard::install_validator(&accounts, &rule, &ValidatorOptions::default()).await?;
    assert_eq!(
        installed,
        ValidatorInstall::Installed {
            existing_violations: vec![]
        }
    );
    assert_eq!(t.validator_of("accounts").await?, Some(combined.clone()));
    assert!(both_rules_hold(&accounts).await?);

    // As session 16 rendered `balance >= 0` (no type bracket: a string balance passed),
    // combined with the schema, the schema second.
    let before_17 = doc! { "$expr": { "$and": [
        { "$gte": ["$balance", { "$literal": 0_i64 }] },
    ]}};
    let old = doc! { "$and": [before_17, schema.clone()] };
    t.db.run_command(doc! { "create": "old", "validator": old.clone() })
        .await?;
    let old_coll = t.db.collection::<Document>("old");
    let upgraded = guard::install_validator(&old_coll, &rule, &ValidatorOptions::default()).await?;
    assert_eq!(
        upgraded,
        ValidatorInstall::Upgraded {
            previous: old,
            existing_violations: vec![]
        }
    );
    assert_eq!(
        t.validator_of("old").await?,
        Some(doc! { "$and": [guard::validator_document(&rule), schema.clone()] })
    );
    assert!(both_rules_hold(&old_coll).await?);

    // Still someone else's: an `$or` (the invariants need not hold), and an `$and` holding
    // the invariants twice.
    let others = [
        doc! { "$or": [schema.clone(), guard::validator_document(&rule)] },
        doc! { "$and": [guard::validator_document(&rule), schema, guard::validator_document(&rule)] },
    ];
    for (i, other) in others.into_iter().enumerate() {
        let name = format!("other{i}");
        t.db.run_command(doc! { "create": &name, "validator": other.clone() })
            .await?;
        let coll = t.db.collection::<Document>(&name);
        let kept = guard::install_validator(&coll, &rule, &ValidatorOptions::default()).await?;
        assert_eq!(
            kept,
            ValidatorInstall::OtherValidator {
                validator: other.clone()
            }
        );
        assert_eq!(t.validator_of(&name).await?, Some(other));
    }
    Ok(())
}
