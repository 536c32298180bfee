//! A client that records the commands it sends (driver command monitoring), for tests
//! that count round trips or check what a command asked for.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use mongodb::Client;
use mongodb::bson::Document;
use mongodb::event::EventHandler;
use mongodb::event::command::CommandEvent;
use mongodb::options::ClientOptions;

/// The commands a [`counting_client`] has started (name and body), in order.
#[derive(Clone, Debug, Default)]
pub struct CommandLog(Arc<Mutex<Vec<(String, Document)>>>);

impl CommandLog {
    /// The names of the commands recorded since the last `take` (or since the client was
    /// made), in the order they were sent; the log starts empty again.
    pub fn take(&self) -> Vec<String> {
        self.take_bodies()
            .into_iter()
            .map(|(name, _)| name)
            .collect()
    }

    /// The commands recorded since the last `take`, each as its name and the body the
    /// driver sent, in order; the log starts empty again.
    pub fn take_bodies(&self) -> Vec<(String, Document)> {
        self.0
            .lock()
            .map(|mut commands| std::mem::take(&mut *commands))
            .unwrap_or_default()
    }

    /// How many of each command were recorded since the last `take`, by name; the log
    /// starts empty again.
    pub fn take_counts(&self) -> BTreeMap<String, u32> {
        let mut counts = BTreeMap::new();
        for name in self.take() {
            *counts.entry(name).or_default() += 1;
        }
        counts
    }

    fn push(&self, name: String, body: Document) {
        if let Ok(mut commands) = self.0.lock() {
            commands.push((name, body));
        }
    }
}

/// A new client of the server at `uri` that records every command it starts in the
/// returned log (the handshake and the monitoring's heartbeats are not commands here).
///
/// # Errors
/// `uri` does not parse, or the client cannot be made.
pub async fn counting_client(uri: &str) -> mongodb::error::Result<(Client, CommandLog)> {
    let log = CommandLog::default();
    let mut options = ClientOptions::parse(uri).await?;
    let l = log.clone();
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(e) = event {
            l.push(e.command_name, e.command);
        }
    }));
    Ok((Client::with_options(options)?, log))
}
