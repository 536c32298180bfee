//! MongoDB's `failCommand` fail point, the fault injection the official drivers' test
//! suites use (`--enable-test-commands` on the embedded server, `enableTestCommands` on
//! MongoDB). A fail point is server-wide and each configuration replaces the last, so a
//! test binary that uses it runs its cases in turn, on its own server.

use mongodb::Client;
use mongodb::bson::{Bson, Document, doc};

/// Makes `commands` fail with error `code` (and no error labels) in `mode`: `{times: n}`
/// for the next `n` of them, or `"alwaysOn"`.
///
/// # Errors
/// The server's refusal, for example where fail points are not enabled.
pub async fn fail_commands(
    client: &Client,
    commands: &[&str],
    code: i32,
    mode: Bson,
) -> mongodb::error::Result<Document> {
    fail_with_code(client, None, commands, code, mode).await
}

/// As [`fail_commands`], for the commands of clients named `app_name` alone (the client
/// option `appName`, see [`app_client`]): the test's other clients are not affected.
///
/// # Errors
/// The server's refusal, for example where fail points are not enabled.
pub async fn fail_commands_of(
    client: &Client,
    app_name: &str,
    commands: &[&str],
    code: i32,
    mode: Bson,
) -> mongodb::error::Result<Document> {
    fail_with_code(client, Some(app_name), commands, code, mode).await
}

/// [`fail_commands`] and [`fail_commands_of`]: `commands` (of clients named `app_name`,
/// if given) fail with error `code` in `mode`.
async fn fail_with_code(
    client: &Client,
    app_name: Option<&str>,
    commands: &[&str],
    code: i32,
    mode: Bson,
) -> mongodb::error::Result<Document> {
    let mut data = doc! { "failCommands": commands, "errorCode": code };
    if let Some(app_name) = app_name {
        data.insert("appName", app_name);
    }
    fail_command(client, mode, data).await
}

/// Configures the `failCommand` fail point with `mode` and `data`.
async fn fail_command(
    client: &Client,
    mode: Bson,
    data: Document,
) -> mongodb::error::Result<Document> {
    client
        .database("admin")
        .run_command(doc! { "configureFailPoint": "failCommand", "mode": mode, "data": data })
        .await
}

/// Makes `commands` apply and then answer with a retryable write concern error (91,
/// ShutdownInProgress) in `mode` (`{times: n}` or `"alwaysOn"`): the write happened, its
/// reply is lost — what a failover between a write and its acknowledgement looks like to
/// the client, the driver's own retry included.
///
/// # Errors
/// The server's refusal, for example where fail points are not enabled.
pub async fn lose_replies(
    client: &Client,
    commands: &[&str],
    mode: Bson,
) -> mongodb::error::Result<Document> {
    fail_command(
        client,
        mode,
        doc! {
            "failCommands": commands,
            "writeConcernError": { "code": 91, "errmsg": "injected: reply lost" },
        },
    )
    .await
}

/// Holds the connection of the next `command` sent by clients named `app_name` (the
/// client option `appName`) for `hold`, then runs it: a write that reaches the server late,
/// after its caller may have given up. Other clients are not affected.
///
/// # Errors
/// The server's refusal, for example where fail points are not enabled.
pub async fn hold_next(
    client: &Client,
    app_name: &str,
    command: &str,
    hold: std::time::Duration,
) -> mongodb::error::Result<Document> {
    let ms = i32::try_from(hold.as_millis()).unwrap_or(i32::MAX);
    client
        .database("admin")
        .run_command(doc! {
            "configureFailPoint": "failCommand",
            "mode": { "times": 1 },
            "data": {
                "failCommands": [command],
                "blockConnection": true,
                "blockTimeMS": ms,
                "appName": app_name,
            },
        })
        .await
}

/// Turns the `failCommand` fail point off. A test calls it first, to find out whether the
/// server has fail points at all (and to skip if not).
///
/// A fail point that answers with a state-change error (91, ShutdownInProgress, say)
/// makes the driver clear the client's pool, which fails the operations in flight on the
/// same client — this command among them, when the code under test is still sending
/// commands that fail (`tests/lock_lost_reply.rs` failed so under load). Turning the fail
/// point off is idempotent, so a transient error is retried, for up to 5 s. Code that
/// retries quickly on the same client can clear its pool before every try (session 34):
/// where it can, a test turns the fail point off through another client (its `TestDb`'s;
/// fail points are server-wide).
///
/// # Errors
/// The server's refusal, for example where fail points are not enabled.
pub async fn fail_commands_off(client: &Client) -> mongodb::error::Result<Document> {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let r = client
            .database("admin")
            .run_command(doc! { "configureFailPoint": "failCommand", "mode": "off" })
            .await;
        match r {
            Err(e) if std::time::Instant::now() < until && is_transient(&e) => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            r => return r,
        }
    }
}

/// A network error, a cleared pool, or a server-selection timeout: not a refusal.
fn is_transient(e: &mongodb::error::Error) -> bool {
    use mongodb::error::ErrorKind;
    matches!(
        *e.kind,
        ErrorKind::Io(_)
            | ErrorKind::ConnectionPoolCleared { .. }
            | ErrorKind::ServerSelection { .. }
    )
}

/// A client of `t`'s server for a test that injects faults with [`fail_commands`], or
/// `None` (the skip is reported for `test`) where the server has no fail points. The
/// client checks the server every 500 ms: after a not-primary error the driver waits for
/// its next check before it selects the server again (10 s by default), and waits up to
/// 20 s for one.
///
/// # Errors
/// The URI does not parse or the client cannot be built.
pub async fn fail_point_client(
    t: &crate::TestDb,
    test: &str,
) -> mongodb::error::Result<Option<Client>> {
    if let Err(e) = fail_commands_off(&t.client).await {
        crate::skip(
            test,
            &format!("the server has no failCommand fail point: {e}"),
        );
        return Ok(None);
    }
    client_of(t, None).await.map(Some)
}

/// A client of `t`'s server named `app_name` (the client option `appName`), so that a
/// fail point with `appName` in its data ([`hold_next`], or `failCommand` configured by
/// hand) acts on its commands alone. It checks the server as often as
/// [`fail_point_client`]'s, for the same reason.
///
/// # Errors
/// The URI does not parse or the client cannot be built.
pub async fn app_client(t: &crate::TestDb, app_name: &str) -> mongodb::error::Result<Client> {
    client_of(t, Some(app_name)).await
}

/// A client of `t`'s server that checks it every 500 ms and waits up to 20 s to select it.
async fn client_of(t: &crate::TestDb, app_name: Option<&str>) -> mongodb::error::Result<Client> {
    let mut options = mongodb::options::ClientOptions::parse(t.uri()).await?;
    options.app_name = app_name.map(str::to_owned);
    options.heartbeat_freq = Some(std::time::Duration::from_millis(500));
    options.server_selection_timeout = Some(std::time::Duration::from_secs(20));
    Client::with_options(options)
}

/// What a test that aims fail points at one client needs: [`crate::TestDb::new`] for
/// `test` (its database, on a client no fail point names), the client that configures the
/// fail points ([`fail_point_client`]), and the client named `app_name` ([`app_client`])
/// whose commands [`fail_commands_of`] and [`hold_next`] act on, in that order. `None`
/// (the skip is reported for `test`) where the server has no fail points.
///
/// # Errors
/// As [`crate::TestDb::new`]; a client that cannot be built.
pub async fn app_faults(
    test: &str,
    app_name: &str,
) -> crate::Result<Option<(crate::TestDb, Client, Client)>> {
    let t = crate::TestDb::new(test).await?;
    let Some(admin) = fail_point_client(&t, test).await? else {
        return Ok(None);
    };
    let app = app_client(&t, app_name).await?;
    Ok(Some((t, admin, app)))
}
