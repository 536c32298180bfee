//! OpenTelemetry export of docwarden's spans (cargo feature `otel`, off by default).
//!
//! When `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set,
//! the command's tracing subscriber gets a `tracing-opentelemetry` layer that sends every
//! span (the `job` span of each handler run, the claim and settle bulks, lock operations;
//! see `docwarden::observe`) to that OTLP/HTTP collector in batches. Which spans go is
//! chosen by `DOCWARDEN_OTEL_FILTER` (an `EnvFilter` directive, default `docwarden=info`),
//! independently of `RUST_LOG`, which keeps choosing what is printed on stderr. The
//! service name is `OTEL_SERVICE_NAME`, else `docwarden`; the other standard `OTEL_*`
//! variables (headers, timeout) apply as the exporter reads them.
//!
//! **Limits:** spans still queued when the process is killed are lost; a normal exit
//! flushes them (the [`Guard`] shuts the provider down).

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::Layer;
use tracing_subscriber::registry::LookupSpan;

/// Flushes and shuts the exporter down when dropped (at the end of `main`).
pub(crate) struct Guard(SdkTracerProvider);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Err(e) = self.0.shutdown() {
            eprintln!("docwarden: OpenTelemetry shutdown: {e}");
        }
    }
}

fn set(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| !v.is_empty())
}

/// A boxed layer of the command's subscriber.
pub(crate) type BoxedLayer<S> = Box<dyn Layer<S> + Send + Sync>;

/// The export layer, filtered by `DOCWARDEN_OTEL_FILTER`, if an OTLP endpoint is set.
///
/// # Errors
/// The exporter cannot be built (a bad endpoint or header variable).
pub(crate) fn layer<S>() -> anyhow::Result<Option<(BoxedLayer<S>, Guard)>>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    if !set("OTEL_EXPORTER_OTLP_ENDPOINT") && !set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()?;
    let mut resource = Resource::builder();
    if !set("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name("docwarden");
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    let filter = tracing_subscriber::EnvFilter::try_from_env("DOCWARDEN_OTEL_FILTER")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("docwarden=info"));
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("docwarden"))
        .with_filter(filter)
        .boxed();
    Ok(Some((layer, Guard(provider))))
}
