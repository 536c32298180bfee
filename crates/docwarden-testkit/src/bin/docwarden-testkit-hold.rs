//! Test helper: starts an embedded server, prints its directory, and waits to be killed.
//! Used to show that a killed owner leaves no orphan server.

#[tokio::main]
async fn main() -> Result<(), docwarden_testkit::Error> {
    let server = docwarden_testkit::EmbeddedServer::start(Default::default()).await?;
    println!("{}", server.dir().display());
    tokio::time::sleep(std::time::Duration::from_secs(600)).await;
    drop(server);
    Ok(())
}
