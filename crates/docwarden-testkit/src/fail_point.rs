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
    client
        .database("admin")
        .run_command(doc! {
            "configureFailPoint": "failCommand",
            "mode": mode,
            "data": { "failCommands": commands, "errorCode": code },
        })
        .await
}

/// Turns the `failCommand` fail point off. A test calls it first, to find out whether the
/// server has fail points at all (and to skip if not).
///
/// # Errors
/// The server's refusal, for example where fail points are not enabled.
pub async fn fail_commands_off(client: &Client) -> mongodb::error::Result<Document> {
    client
        .database("admin")
        .run_command(doc! { "configureFailPoint": "failCommand", "mode": "off" })
        .await
}
