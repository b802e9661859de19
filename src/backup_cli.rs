//! `reports-server backup`: a consistent copy of the embedded SQLite database, taken while
//! the server runs, for analysts (open the copy with any SQLite tool, or `query --data-dir`)
//! and as a backup (restore it with docs/operations.md "Restoring a backup").

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::query_cli::DatabaseLocation;

#[derive(Args)]
pub struct BackupArgs {
    /// The file to write (must not exist).
    #[arg(long, env = "REPORTS_SERVER_BACKUP_TO")]
    to: PathBuf,
    #[command(flatten)]
    location: DatabaseLocation,
    /// Seconds to wait for the database.
    #[arg(
        long,
        env = "REPORTS_SERVER_DB_CONNECT_TIMEOUT_SECONDS",
        default_value_t = 10
    )]
    db_connect_timeout_seconds: u64,
}

pub async fn run(args: BackupArgs) -> anyhow::Result<()> {
    let url = args.location.url()?;
    let timeout = Duration::from_secs(args.db_connect_timeout_seconds);
    let bytes = reports_server_analytics::copy_sqlite(&url, &args.to, timeout).await?;
    println!(
        "copied the database into {} ({bytes} bytes)",
        args.to.display()
    );
    Ok(())
}
