//! An HTTP inference service (axum) whose model runs in process-isolated workers that
//! share one copy of the weights, with a load generator that measures it.
//!
//! The parent saves a small MLP (4 MiB of `f32` weights) as safetensors and loads it
//! with [`multiproc::safetensors::load`]: the file's pages, mapped read-only and shared.
//! It starts N worker processes, each receiving the weights *by handle* and serving
//! requests from a queue of its own; answers come back on one queue to a router that
//! hands each to the HTTP request waiting for it. Nothing blocks a thread: the router
//! awaits the answers (`Queue::get_async`) and each worker's supervisor its exit
//! (`Process::join_async`), all on the server's tokio runtime.
//!
//! A worker that dies — SIGKILLed by an operator, OOM-killed, crashed — costs exactly
//! the request it was computing: that request gets `503 Service Unavailable` (saying
//! which worker died), the requests queued behind it go to the other workers, and a
//! replacement worker starts on the same weights while the others keep serving. Every
//! request whose answer came back is checked against the parent's own prediction.
//!
//! The built-in load generator (16 keep-alive connections, each posting JSON inputs
//! back to back) runs three phases and prints requests/s and p50/p99 latency for each:
//! 1 worker, N workers, and N workers with one of them SIGKILLed mid-request.
//!
//! ```text
//! cargo run --release -p multiproc --features safetensors,ndarray,async --example inference_service
//! cargo run --release -p multiproc --features safetensors,ndarray,async --example inference_service -- --workers 4 --seconds 5
//! cargo run --release -p multiproc --features safetensors,ndarray,async --example inference_service -- --serve 127.0.0.1:8080
//! ```
//!
//! With `--serve ADDR` it only serves, until Ctrl-C: `POST /predict` with a JSON array
//! of 512 numbers answers `{"class": c, "worker": pid}`; `GET /workers` lists the
//! workers' pids (kill one with `kill -9` and watch it being replaced).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use multiproc::{Process, Queue, StartMethod, Tensor};
use ndarray::{ArrayView1, ArrayView2, ArrayViewD, Ix1, Ix2};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;

const INPUT: usize = 512;
const HIDDEN: usize = 2048;
const CLASSES: usize = 16;
/// Connections of the load generator.
const CONNECTIONS: usize = 16;
/// Distinct inputs the load generator sends (and whose answers it checks).
const INPUTS: usize = 64;
/// How long a request waits for its answer before a `504`.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

type Weights = BTreeMap<String, Tensor>;
/// A job for a worker: request id and input; `None` asks the worker to stop.
type Job = Option<(u64, Vec<f32>)>;
/// An answer: request id, the worker's pid, the predicted class.
type Answer = (u64, u32, usize);

/// The names of the model's tensors, in the order [`Mlp`] takes them.
const NAMES: [&str; 4] = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];

/// The model as ndarray views of the shared, read-only weights.
struct Mlp<'a> {
    w1: ArrayView2<'a, f32>,
    b1: ArrayView1<'a, f32>,
    w2: ArrayView2<'a, f32>,
    b2: ArrayView1<'a, f32>,
}

impl<'a> Mlp<'a> {
    /// Zero-copy views of the weights. The safe `array_view` refuses a read-only file's
    /// pages (any process that can open the file could write them under a Rust borrow),
    /// so this takes the `unsafe` view under its contract.
    fn new(handles: &'a mut [Tensor; 4]) -> multiproc::Result<Mlp<'a>> {
        let dim = |e: ndarray::ShapeError| multiproc::Error::Tensor(e.to_string());
        let [a, b, c, d] = handles;
        // SAFETY: the example writes the weights file once, before loading it, and no
        // process writes it again while the model's views live.
        let views: [ArrayViewD<'a, f32>; 4] = unsafe {
            [
                a.as_array_view()?,
                b.as_array_view()?,
                c.as_array_view()?,
                d.as_array_view()?,
            ]
        };
        let [w1, b1, w2, b2] = views;
        Ok(Mlp {
            w1: w1.into_dimensionality::<Ix2>().map_err(dim)?,
            b1: b1.into_dimensionality::<Ix1>().map_err(dim)?,
            w2: w2.into_dimensionality::<Ix2>().map_err(dim)?,
            b2: b2.into_dimensionality::<Ix1>().map_err(dim)?,
        })
    }

    fn predict(&self, x: &[f32]) -> usize {
        let hidden = (self.w1.dot(&ArrayView1::from(x)) + self.b1).mapv(|v| v.max(0.0));
        let logits = self.w2.dot(&hidden) + self.b2;
        let mut best = (0, f32::MIN);
        for (i, &v) in logits.iter().enumerate() {
            if v > best.1 {
                best = (i, v);
            }
        }
        best.0
    }
}

fn handles(weights: &Weights) -> multiproc::Result<[Tensor; 4]> {
    let mut out = Vec::with_capacity(4);
    for name in NAMES {
        let t = weights
            .get(name)
            .ok_or_else(|| multiproc::Error::Tensor(format!("the model has no {name}")))?;
        out.push(t.clone());
    }
    out.try_into()
        .map_err(|_| multiproc::Error::Tensor("four tensors".into()))
}

/// A worker process: answers its jobs until told to stop.
fn worker(
    _rank: usize,
    (weights, jobs, answers): (Weights, Queue<Job>, Queue<Answer>),
) -> multiproc::Result<()> {
    let mut shared = handles(&weights)?;
    let model = Mlp::new(&mut shared)?;
    let pid = std::process::id();
    while let Some((id, x)) = jobs.get()? {
        answers.put((id, pid, model.predict(&x)))?;
    }
    Ok(())
}

/// What a request is told.
enum Reply {
    Class { class: usize, worker: u32 },
    WorkerDied { pid: u32 },
}

/// One worker's place: its job queue, its pid, and the requests sent to it in order
/// (the first is the one it is computing).
struct Slot {
    jobs: Queue<Job>,
    pid: u32,
    in_flight: VecDeque<u64>,
}

struct Waiting {
    input: Arc<Vec<f32>>,
    reply: oneshot::Sender<Reply>,
    slot: usize,
}

/// The router's books: every slot and every request waiting for an answer.
#[derive(Default)]
struct Books {
    slots: Vec<Slot>,
    waiting: HashMap<u64, Waiting>,
    next_id: u64,
    /// Workers that died and were replaced.
    replaced: usize,
}

impl Books {
    /// Sends request `id` to the worker with the fewest requests.
    fn dispatch(&mut self, id: u64) -> multiproc::Result<()> {
        let Some(w) = self.waiting.get_mut(&id) else {
            return Ok(());
        };
        let slot = (0..self.slots.len())
            .min_by_key(|&s| self.slots[s].in_flight.len())
            .ok_or_else(|| multiproc::Error::Tensor("no worker".into()))?;
        w.slot = slot;
        self.slots[slot].in_flight.push_back(id);
        self.slots[slot]
            .jobs
            .put(Some((id, w.input.to_vec())))
            .map_err(multiproc::Error::from)
    }
}

struct Service {
    books: Mutex<Books>,
    weights: Weights,
    answers: Queue<Answer>,
    stopping: AtomicBool,
}

impl Service {
    fn books(&self) -> MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts a worker process on a fresh job queue.
    fn start_worker(&self) -> multiproc::Result<(Process, Queue<Job>)> {
        let jobs = Queue::new()?;
        let p = Process::builder(
            worker,
            0,
            (self.weights.clone(), jobs.clone(), self.answers.clone()),
        )
        .start_method(StartMethod::Spawn)
        .name("inference-worker")
        .start()?;
        Ok((p, jobs))
    }

    /// Queues one request; the receiver gets its reply.
    fn submit(&self, input: Vec<f32>) -> multiproc::Result<oneshot::Receiver<Reply>> {
        let (tx, rx) = oneshot::channel();
        let mut books = self.books();
        let id = books.next_id;
        books.next_id += 1;
        books.waiting.insert(
            id,
            Waiting {
                input: Arc::new(input),
                reply: tx,
                slot: 0,
            },
        );
        if let Err(e) = books.dispatch(id) {
            books.waiting.remove(&id);
            return Err(e);
        }
        Ok(rx)
    }

    /// The router: hands each answer to the request waiting for it, until the last
    /// worker has stopped (the answers queue is then `Disconnected`: no other handle of
    /// it is left, and nothing can arrive any more).
    async fn route(&self) -> multiproc::Result<()> {
        loop {
            let (id, pid, class) = match self.answers.get_async().await {
                Ok(answer) => answer,
                Err(multiproc::Error::Disconnected(_)) => return Ok(()),
                Err(e) => return Err(e),
            };
            let mut books = self.books();
            if let Some(w) = books.waiting.remove(&id) {
                books.slots[w.slot].in_flight.retain(|&i| i != id);
                let _ = w.reply.send(Reply::Class { class, worker: pid });
            }
        }
    }

    /// Watches slot `slot`'s worker; when it dies, fails the request it was computing,
    /// starts a replacement and sends it the requests queued behind.
    async fn supervise(&self, slot: usize, mut process: Process) -> multiproc::Result<()> {
        loop {
            let status = process.join_async().await?;
            if self.stopping.load(Ordering::Acquire) {
                return Ok(());
            }
            let (replacement, jobs) = self.start_worker()?;
            let new_pid = replacement.pid();
            let mut books = self.books();
            let dead_pid = books.slots[slot].pid;
            let orphans: Vec<u64> = books.slots[slot].in_flight.drain(..).collect();
            books.slots[slot].jobs = jobs;
            books.slots[slot].pid = new_pid;
            books.replaced += 1;
            let mut orphans = orphans.into_iter();
            if let Some(first) = orphans.next() {
                if let Some(w) = books.waiting.remove(&first) {
                    let _ = w.reply.send(Reply::WorkerDied { pid: dead_pid });
                }
            }
            for id in orphans {
                books.dispatch(id)?;
            }
            drop(books);
            eprintln!("worker {dead_pid} ended ({status}); replaced by worker {new_pid}");
            process = replacement;
        }
    }
}

async fn predict(
    State(service): State<Arc<Service>>,
    Json(input): Json<Vec<f32>>,
) -> Result<Json<serde_json::Value>, (StatusCode, String)> {
    if input.len() != INPUT {
        return Err((
            StatusCode::BAD_REQUEST,
            format!(
                "the input has {} numbers; the model takes {INPUT}",
                input.len()
            ),
        ));
    }
    let unavailable = |e: multiproc::Error| (StatusCode::SERVICE_UNAVAILABLE, e.to_string());
    let reply = service.submit(input).map_err(unavailable)?;
    match tokio::time::timeout(ANSWER_TIMEOUT, reply).await {
        Ok(Ok(Reply::Class { class, worker })) => Ok(Json(
            serde_json::json!({ "class": class, "worker": worker }),
        )),
        Ok(Ok(Reply::WorkerDied { pid })) => Err((
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "worker {pid} died while computing this request; a replacement is starting, retry"
            ),
        )),
        Ok(Err(_)) => Err((
            StatusCode::SERVICE_UNAVAILABLE,
            "the service is stopping".into(),
        )),
        Err(_) => Err((StatusCode::GATEWAY_TIMEOUT, "no answer in time".into())),
    }
}

async fn workers(State(service): State<Arc<Service>>) -> Json<Vec<u32>> {
    Json(service.books().slots.iter().map(|s| s.pid).collect())
}

/// A running service: its HTTP address and the tasks that route and supervise.
struct Running {
    service: Arc<Service>,
    addr: std::net::SocketAddr,
    supervisors: Vec<tokio::task::JoinHandle<multiproc::Result<()>>>,
    router: tokio::task::JoinHandle<multiproc::Result<()>>,
    server: tokio::task::JoinHandle<()>,
    shutdown: oneshot::Sender<()>,
}

async fn start(weights: &Weights, n: usize, addr: &str) -> multiproc::Result<Running> {
    let service = Arc::new(Service {
        books: Mutex::new(Books::default()),
        weights: weights.clone(),
        answers: Queue::new()?,
        stopping: AtomicBool::new(false),
    });
    let mut supervisors = Vec::new();
    for slot in 0..n {
        let (process, jobs) = service.start_worker()?;
        service.books().slots.push(Slot {
            jobs,
            pid: process.pid(),
            in_flight: VecDeque::new(),
        });
        let s = Arc::clone(&service);
        supervisors.push(tokio::spawn(
            async move { s.supervise(slot, process).await },
        ));
    }
    let s = Arc::clone(&service);
    let router = tokio::spawn(async move { s.route().await });
    let app = axum::Router::new()
        .route("/predict", post(predict))
        .route("/workers", get(workers))
        .with_state(Arc::clone(&service));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| multiproc::Error::Tensor(format!("binding {addr}: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| multiproc::Error::Tensor(e.to_string()))?;
    let (shutdown, stop) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stop.await;
            })
            .await;
    });
    Ok(Running {
        service,
        addr,
        supervisors,
        router,
        server,
        shutdown,
    })
}

impl Running {
    /// Stops the server, the workers (each finishes its queue), the supervisors and the
    /// router.
    async fn stop(self) -> multiproc::Result<usize> {
        let _ = self.shutdown.send(());
        let _ = self.server.await;
        self.service.stopping.store(true, Ordering::Release);
        for slot in &self.service.books().slots {
            slot.jobs.put(None)?;
        }
        let gone = |what: &'static str| {
            move |e: tokio::task::JoinError| {
                multiproc::Error::Tensor(format!("the {what} task failed: {e}"))
            }
        };
        for t in self.supervisors {
            t.await.map_err(gone("supervisor"))??;
        }
        self.router.await.map_err(gone("router"))??;
        let replaced = self.service.books().replaced;
        Ok(replaced)
    }
}

/// One HTTP/1.1 keep-alive connection of the load generator.
struct Client {
    stream: BufReader<tokio::net::TcpStream>,
}

impl Client {
    async fn connect(addr: std::net::SocketAddr) -> std::io::Result<Self> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream: BufReader::new(stream),
        })
    }

    /// Posts `body` to /predict; the status and the response body.
    async fn predict(&mut self, body: &str) -> std::io::Result<(u16, String)> {
        let head = format!(
            "POST /predict HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let s = self.stream.get_mut();
        s.write_all(head.as_bytes()).await?;
        s.write_all(body.as_bytes()).await?;
        let mut line = String::new();
        self.stream.read_line(&mut line).await?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
        let mut length = 0usize;
        loop {
            line.clear();
            self.stream.read_line(&mut line).await?;
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((k, v)) = header.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().map_err(std::io::Error::other)?;
                }
            }
        }
        let mut body = vec![0; length];
        self.stream.read_exact(&mut body).await?;
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }
}

/// What one phase of load measured.
#[derive(Default)]
struct Measured {
    latencies: Vec<Duration>,
    unavailable: Vec<String>,
    wrong: usize,
    other: Vec<(u16, String)>,
    seconds: f64,
}

impl Measured {
    fn percentile(&self, p: f64) -> Duration {
        let mut l = self.latencies.clone();
        l.sort();
        l.get(((l.len() as f64 * p) as usize).min(l.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    }

    fn print(&self, label: &str) {
        println!(
            "{label:<34} {:>8.0} req/s   p50 {:>7.2} ms   p99 {:>7.2} ms   {} answered, {} x 503",
            self.latencies.len() as f64 / self.seconds,
            self.percentile(0.50).as_secs_f64() * 1e3,
            self.percentile(0.99).as_secs_f64() * 1e3,
            self.latencies.len(),
            self.unavailable.len()
        );
    }
}

/// Runs `CONNECTIONS` connections for `seconds`; at `kill_at` (a fraction of the run)
/// SIGKILLs a worker that is computing a request.
async fn load(
    running: &Running,
    inputs: &Arc<Vec<(String, usize)>>,
    seconds: f64,
    kill_at: Option<f64>,
) -> multiproc::Result<Measured> {
    let io = |e: std::io::Error| multiproc::Error::Tensor(format!("load generator: {e}"));
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for c in 0..CONNECTIONS {
        let inputs = Arc::clone(inputs);
        let addr = running.addr;
        tasks.push(tokio::spawn(async move {
            let mut client = Client::connect(addr).await?;
            let mut m = Measured::default();
            let mut i = c;
            while Instant::now() < until {
                let (body, expected) = &inputs[i % inputs.len()];
                i += 7;
                let sent = Instant::now();
                let (status, text) = client.predict(body).await?;
                match status {
                    200 => {
                        m.latencies.push(sent.elapsed());
                        let answer: serde_json::Value =
                            serde_json::from_str(&text).map_err(std::io::Error::other)?;
                        if answer["class"].as_u64() != Some(*expected as u64) {
                            m.wrong += 1;
                        }
                    }
                    503 => m.unavailable.push(text),
                    _ => m.other.push((status, text)),
                }
            }
            Ok::<_, std::io::Error>(m)
        }));
    }
    let mut killed = None;
    if let Some(at) = kill_at {
        tokio::time::sleep(Duration::from_secs_f64(seconds * at)).await;
        // A worker in the middle of a request (one always is, under this load).
        let victim = {
            let books = running.service.books();
            books
                .slots
                .iter()
                .find(|s| !s.in_flight.is_empty())
                .map(|s| s.pid)
        };
        if let Some(pid) = victim {
            // SAFETY: kill(2) has no memory-safety preconditions.
            if unsafe { libc::kill(pid as i32, libc::SIGKILL) } == 0 {
                killed = Some(pid);
                println!(
                    "  (SIGKILLed worker {pid} mid-request at {:.1} s)",
                    start.elapsed().as_secs_f64()
                );
            }
        }
    }
    let mut all = Measured {
        seconds,
        ..Measured::default()
    };
    for t in tasks {
        let m = t
            .await
            .map_err(|e| multiproc::Error::Tensor(e.to_string()))?
            .map_err(io)?;
        all.latencies.extend(m.latencies);
        all.unavailable.extend(m.unavailable);
        all.wrong += m.wrong;
        all.other.extend(m.other);
    }
    if all.wrong > 0 || !all.other.is_empty() {
        return Err(multiproc::Error::Tensor(format!(
            "{} wrong answers, other responses: {:?}",
            all.wrong,
            all.other.iter().take(3).collect::<Vec<_>>()
        )));
    }
    let expected_503s = usize::from(killed.is_some());
    let named = killed.is_none_or(|pid| {
        all.unavailable
            .iter()
            .all(|text| text.contains(&pid.to_string()))
    });
    if all.unavailable.len() != expected_503s || !named {
        return Err(multiproc::Error::Tensor(format!(
            "a worker killed ({killed:?}) should cost exactly its one request, got {:?}",
            all.unavailable
        )));
    }
    Ok(all)
}

fn make_model() -> multiproc::Result<Weights> {
    // Deterministic pseudo-random weights (a small LCG), scaled like an initialised MLP.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut values = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    };
    let s1 = 2.0 / (INPUT as f32).sqrt();
    let s2 = 2.0 / (HIDDEN as f32).sqrt();
    let mut m = BTreeMap::new();
    m.insert(
        "fc1.weight".into(),
        Tensor::from_vec(values(HIDDEN * INPUT, s1), &[HIDDEN, INPUT])?,
    );
    m.insert(
        "fc1.bias".into(),
        Tensor::from_vec(values(HIDDEN, 0.1), &[HIDDEN])?,
    );
    m.insert(
        "fc2.weight".into(),
        Tensor::from_vec(values(CLASSES * HIDDEN, s2), &[CLASSES, HIDDEN])?,
    );
    m.insert(
        "fc2.bias".into(),
        Tensor::from_vec(values(CLASSES, 0.1), &[CLASSES])?,
    );
    Ok(m)
}

/// The command line: `--workers N`, `--seconds S`, `--serve ADDR`.
struct Options {
    workers: usize,
    seconds: f64,
    serve: Option<String>,
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        workers: std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .clamp(2, 8),
        seconds: 3.0,
        serve: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--workers" => {
                o.workers = value("--workers")?
                    .parse()
                    .map_err(|e| format!("--workers: {e}"))?
            }
            "--seconds" => {
                o.seconds = value("--seconds")?
                    .parse()
                    .map_err(|e| format!("--seconds: {e}"))?
            }
            "--serve" => o.serve = Some(value("--serve")?),
            other => {
                return Err(format!(
                    "unknown argument {other:?} (--workers N, --seconds S, --serve ADDR)"
                ));
            }
        }
    }
    if o.workers == 0 || o.seconds <= 0.0 {
        return Err("--workers and --seconds must be positive".into());
    }
    Ok(o)
}

/// The process's open fds, each with what it refers to.
fn open_fds() -> std::collections::BTreeMap<String, String> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Default::default();
    };
    dir.flatten()
        .map(|e| {
            let what = std::fs::read_link(e.path())
                .map_or_else(|e| e.to_string(), |t| t.display().to_string());
            (e.file_name().to_string_lossy().into_owned(), what)
        })
        .collect()
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let o = options().map_err(multiproc::Error::InvalidArgument)?;
    serve_or_measure(o)
}

fn serve_or_measure(o: Options) -> multiproc::Result<()> {
    let dir = std::env::temp_dir().join(format!("multiproc-service-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| multiproc::Error::Tensor(format!("{}: {e}", dir.display())))?;
    let path = dir.join("mlp.safetensors");
    multiproc::safetensors::save(&path, &make_model()?)?;
    let weights = multiproc::safetensors::load(&path)?;
    // The mapping keeps the pages; the name is no longer needed.
    let _ = std::fs::remove_dir_all(&dir);

    let mut parent_handles = handles(&weights)?;
    let model = Mlp::new(&mut parent_handles)?;
    let inputs: Arc<Vec<(String, usize)>> = Arc::new(
        (0..INPUTS)
            .map(|r| {
                let x: Vec<f32> = (0..INPUT)
                    .map(|i| (((r * 31 + i * 7) % 97) as f32 / 97.0) - 0.5)
                    .collect();
                let expected = model.predict(&x);
                (serde_json::to_string(&x).unwrap_or_default(), expected)
            })
            .collect(),
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| multiproc::Error::Tensor(format!("tokio runtime: {e}")))?;
    runtime.block_on(async {
        if let Some(addr) = o.serve {
            let running = start(&weights, o.workers, &addr).await?;
            println!("serving on http://{} with {} workers; Ctrl-C stops", running.addr, o.workers);
            let _ = tokio::signal::ctrl_c().await;
            let replaced = running.stop().await?;
            println!("stopped; {replaced} workers were replaced");
            return Ok(());
        }
        println!(
            "model: 4 MiB of weights shared by handle; {CONNECTIONS} connections, {:.1} s per phase",
            o.seconds
        );
        let one = start(&weights, 1, "127.0.0.1:0").await?;
        load(&one, &inputs, o.seconds, None).await?.print("1 worker");
        one.stop().await?;
        // What a process keeps for its life (the launcher, the shm manager's connection)
        // exists now; a stopped service leaves nothing more, a killed worker included.
        let fds_before = open_fds();
        let n = start(&weights, o.workers, "127.0.0.1:0").await?;
        load(&n, &inputs, o.seconds, None).await?.print(&format!("{} workers", o.workers));
        let killed = load(&n, &inputs, o.seconds, Some(0.4)).await?;
        killed.print(&format!("{} workers, one SIGKILLed", o.workers));
        println!("  the request it was computing: 503 {:?}", killed.unavailable[0]);
        let replaced = n.stop().await?;
        if replaced != 1 {
            return Err(multiproc::Error::Tensor(format!("{replaced} workers replaced, expected 1")));
        }
        // Blocks the parent pooled or kept mapped for reuse are let go after about a
        // second without traffic (the library's idle decay): wait for that, with a deadline.
        let deadline = Instant::now() + Duration::from_secs(5);
        let left = loop {
            let left: Vec<String> = open_fds()
                .into_iter()
                .filter(|(fd, what)| fds_before.get(fd) != Some(what))
                .map(|(fd, what)| format!("{fd} -> {what}"))
                .collect();
            if left.is_empty() || Instant::now() > deadline {
                break left;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if !left.is_empty() {
            return Err(multiproc::Error::Tensor(format!(
                "the stopped service left {} fds open: {}",
                left.len(),
                left.join(", ")
            )));
        }
        println!("the dead worker was replaced; every answer matched the parent's own prediction");
        Ok(())
    })
}
