//! Containers for fault injection: `FROM scratch` images around the static
//! binaries `tests/run.sh` builds (no registry is needed), user-defined
//! networks, and the Docker operations testcontainers lacks (kill, network
//! disconnect/connect) through the `docker` CLI.

use std::{path::PathBuf, process::Command, time::Duration};

use testcontainers::{
    ContainerAsync, GenericBuildableImage, GenericImage, ImageExt,
    core::{ContainerPort, WaitFor},
    runners::{AsyncBuilder, AsyncRunner},
};

/// The hook port inside peer containers.
pub const HOOK_PORT: u16 = 50071;
/// The tool port inside peer containers.
pub const TOOL_PORT: u16 = 50061;
/// Lattice's port inside its container.
pub const LATTICE_PORT: u16 = 50051;

/// Fails with a clear message when Docker can't be reached (never a skip).
pub fn require_docker() {
    let ok = Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "Docker is not reachable: these tests run hooks, tools and Lattice in containers. Start dockerd (the CI script does)."
    );
}

/// A static binary built by `tests/run.sh` (or `$LATTICE_STATIC_DIR`).
pub fn static_bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("LATTICE_STATIC_DIR").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| crate::workspace_root().join("target"))
            .join("x86_64-unknown-linux-gnu/debug")
    });
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the static binaries first (tests/run.sh does: RUSTFLAGS='-C target-feature=+crt-static' cargo build --target x86_64-unknown-linux-gnu --bin lattice --bin lattice-test-peer)",
        path.display()
    );
    path
}

/// A unique name for this test process (networks, containers).
pub fn unique(tag: &str) -> String {
    format!("lattice-{tag}-{}", std::process::id())
}

/// The peer image (`lattice-test-peer hook|tool`).
pub async fn peer_image() -> GenericImage {
    let dockerfile = "FROM scratch\nCOPY peer /peer\nENTRYPOINT [\"/peer\"]\n";
    image("lattice-test-peer", dockerfile.to_owned(), &[(static_bin("lattice-test-peer"), "peer")]).await
}

/// The Lattice image, built from the shipped `deploy/docker/Dockerfile`
/// around the static debug build; the config is copied in by
/// [`start_lattice`].
pub async fn lattice_image() -> GenericImage {
    let path = crate::workspace_root().join("deploy/docker/Dockerfile");
    let dockerfile = std::fs::read_to_string(&path).expect("reading deploy/docker/Dockerfile");
    let files = [
        (static_bin("lattice"), "lattice"),
        (PathBuf::from("/etc/ssl/certs/ca-certificates.crt"), "ca-certificates.crt"),
    ];
    image("lattice-test-server", dockerfile, &files).await
}

/// Builds an image from a Dockerfile and the files it copies, tagged with a
/// fingerprint of them (the Dockerfile, each file's size and modification
/// time): a test process reuses the image an earlier one built instead of
/// building it again.
async fn image(name: &str, dockerfile: String, files: &[(PathBuf, &str)]) -> GenericImage {
    use std::hash::{Hash, Hasher};
    require_docker();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    dockerfile.hash(&mut h);
    for (path, target) in files {
        let meta = std::fs::metadata(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        (target, meta.len(), meta.modified().ok()).hash(&mut h);
    }
    let tag = format!("{:016x}", h.finish());
    let built = Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", &format!("{name}:{tag}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if built {
        return GenericImage::new(name, &tag);
    }
    let mut build = GenericBuildableImage::new(name, &tag).with_dockerfile_string(dockerfile);
    for (path, target) in files {
        build = build.with_file(path, *target);
    }
    build.build_image().await.unwrap_or_else(|e| panic!("building the {name} image: {e}"))
}

/// Where and how to run a peer.
#[derive(Debug, Clone, Default)]
pub struct PeerOpts {
    /// Join this network.
    pub network: Option<String>,
    /// The container's name (its DNS name on the network).
    pub name: Option<String>,
}

impl PeerOpts {
    /// On `network`, named `name`.
    pub fn on(network: &str, name: &str) -> Self {
        PeerOpts { network: Some(network.to_owned()), name: Some(name.to_owned()) }
    }
}

/// Starts a hook peer; `args` follow `hook --listen 0.0.0.0:50071`.
pub async fn start_hook(image: &GenericImage, args: &[&str], opts: PeerOpts) -> ContainerAsync<GenericImage> {
    let mut cmd = vec!["hook".to_owned(), "--listen".to_owned(), format!("0.0.0.0:{HOOK_PORT}")];
    cmd.extend(args.iter().map(|a| a.to_string()));
    start_peer(image, HOOK_PORT, cmd, "hook serving", opts).await
}

/// Starts a tool peer; `args` follow `tool --listen 0.0.0.0:50061`.
pub async fn start_tool(image: &GenericImage, args: &[&str], opts: PeerOpts) -> ContainerAsync<GenericImage> {
    let mut cmd = vec!["tool".to_owned(), "--listen".to_owned(), format!("0.0.0.0:{TOOL_PORT}")];
    cmd.extend(args.iter().map(|a| a.to_string()));
    start_peer(image, TOOL_PORT, cmd, "tool serving", opts).await
}

async fn start_peer(
    image: &GenericImage,
    port: u16,
    cmd: Vec<String>,
    ready: &str,
    opts: PeerOpts,
) -> ContainerAsync<GenericImage> {
    let mut req = image
        .clone()
        .with_exposed_port(ContainerPort::Tcp(port))
        .with_wait_for(WaitFor::message_on_stderr(ready))
        .with_cmd(cmd)
        .with_startup_timeout(Duration::from_secs(30));
    if let Some(n) = opts.network {
        req = req.with_network(n);
    }
    if let Some(n) = opts.name {
        req = req.with_container_name(n);
    }
    req.start().await.expect("starting a peer container")
}

/// Starts Lattice in a container with `config`, on `network`.
pub async fn start_lattice(config: &str, network: &str) -> ContainerAsync<GenericImage> {
    start_lattice_with(config, network, "server", &[]).await
}

/// [`start_lattice`], naming the container after `tag` and setting `env`.
pub async fn start_lattice_with(
    config: &str,
    network: &str,
    tag: &str,
    env: &[(&str, &str)],
) -> ContainerAsync<GenericImage> {
    let mut image = lattice_image()
        .await
        .with_exposed_port(ContainerPort::Tcp(LATTICE_PORT))
        .with_wait_for(WaitFor::message_on_stderr("serving"))
        .with_network(network)
        .with_container_name(unique(tag))
        .with_cmd(["serve", "--config", "/etc/lattice/lattice.toml", "--listen", "0.0.0.0:50051"])
        .with_env_var("RUST_LOG", "trace");
    for (k, v) in env {
        image = image.with_env_var(*k, *v);
    }
    image
        .with_copy_to("/etc/lattice/lattice.toml", crate::with_open_auth(config).into_bytes())
        .with_startup_timeout(Duration::from_secs(30))
        .start()
        .await
        .expect("starting the lattice container")
}

/// `http://127.0.0.1:<mapped port>`.
pub async fn host_url(c: &ContainerAsync<GenericImage>, port: u16) -> String {
    format!("http://127.0.0.1:{}", c.get_host_port_ipv4(ContainerPort::Tcp(port)).await.expect("a mapped port"))
}

/// Runs `docker ARGS`, panicking with its stderr on failure.
pub fn docker(args: &[&str]) {
    let out = Command::new("docker").args(args).output().expect("docker CLI");
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A network's gateway (the host's address on it) and subnet.
pub fn network_gateway(network: &str) -> (String, String) {
    let field = |f: &str| {
        let format = format!("{{{{range .IPAM.Config}}}}{{{{.{f}}}}}{{{{end}}}}");
        let out = Command::new("docker").args(["network", "inspect", "--format", &format, network]).output();
        let out = out.expect("docker CLI");
        assert!(out.status.success(), "docker network inspect: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    (field("Gateway"), field("Subnet"))
}

/// The container's address on `network`.
pub fn container_ip(c: &ContainerAsync<GenericImage>, network: &str) -> String {
    let format = format!("{{{{(index .NetworkSettings.Networks {network:?}).IPAddress}}}}");
    let out = Command::new("docker").args(["inspect", "--format", &format, c.id()]).output().expect("docker CLI");
    assert!(out.status.success(), "docker inspect: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Everything a container wrote to stdout and stderr.
pub async fn container_logs(c: &ContainerAsync<GenericImage>) -> String {
    let out = c.stdout_to_vec().await.unwrap_or_default();
    let err = c.stderr_to_vec().await.unwrap_or_default();
    String::from_utf8_lossy(&out).into_owned() + &String::from_utf8_lossy(&err)
}
