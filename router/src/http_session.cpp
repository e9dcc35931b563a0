// One HTTP connection of kdn-router (server_state.h): reads requests (their
// bodies counted against --max-body-buffer-mib), routes them, starts jobs on
// the Backend and writes their answers or streams.
#include <deque>

#include "kdn/common/log.h"
#include "server_state.h"

namespace kdn::router {

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, ServerState& router) : stream_(std::move(socket)), router_(router) {
    ++router_.sessions;
  }
  ~Session() {
    ReleaseBody();
    --router_.sessions;
  }

  void Start() { Read(); }

 private:
  void Read() {
    ReleaseBody();
    parser_.emplace();
    parser_->body_limit(kBodyLimit);
    stream_.expires_after(std::chrono::minutes(5));
    http::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
  }

  // The header is in: the body's bytes (its Content-Length, else the most a
  // body may be) are counted against --max-body-buffer-mib before any is
  // read, and over it the request is refused with 503 and Retry-After, as a
  // connection past --max-connections is.
  void OnHeader(beast::error_code ec) {
    if (!ec && !parser_->is_done()) {
      const uint64_t bytes = parser_->content_length().value_or(kBodyLimit);
      if (!router_.bodies.TryReserve(bytes)) {
        static LogLimiter limiter;
        limiter.Warn(
            "refusing a request body of {} bytes: {} bytes of bodies are buffered "
            "(--max-body-buffer-mib)",
            bytes, router_.bodies.reserved());
        ApiError e;
        e.http_status = 503;
        e.type = "service_unavailable";
        e.message = "the router buffers too many request bodies (--max-body-buffer-mib)";
        keep_alive_ = false;
        retry_after_ = true;
        route_ = "other";
        return ReplyError(e);
      }
      body_reserved_ = bytes;
    }
    if (ec || parser_->is_done()) return OnRead(ec);
    http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  // The body's bytes no longer count against the cap (its request is done,
  // or the session is).
  void ReleaseBody() {
    router_.bodies.Release(body_reserved_);
    body_reserved_ = 0;
  }

  void OnRead(beast::error_code ec) {
    if (ec == http::error::body_limit) {
      ApiError e;
      e.http_status = 413;
      e.message = "the request body is over " + std::to_string(kBodyLimit >> 20) + " MiB";
      keep_alive_ = false;
      route_ = "other";
      ReplyError(e);
      return;
    }
    if (ec) return Close();
    request_ = parser_->release();
    keep_alive_ = request_.keep_alive();
    Handle();
  }

  void Handle() {
    std::string path(request_.target());
    if (auto q = path.find('?'); q != std::string::npos) path.resize(q);
    const auto method = request_.method();
    auto only = [&](http::verb v) {
      if (method == v) return true;
      ApiError e;
      e.http_status = 405;
      e.message = std::string("method ") + std::string(request_.method_string()) +
                  " is not allowed on " + path;
      ReplyError(e);
      return false;
    };
    route_ = path;
    // The API and the status page need a key when keys are configured;
    // /health and /metrics stay open (they name no tenant's data). A
    // browser asked for the page gets a Basic challenge: the key is its
    // password.
    const bool status_page = path == "/" || path == "/status" || path == "/status.json";
    if ((path.starts_with("/v1/") || status_page) && router_.options.api_keys != nullptr) {
      const auto auth = request_[http::field::authorization];
      tenant_ = router_.options.api_keys->TenantOf(std::string_view(auth.data(), auth.size()));
      if (tenant_ == nullptr) {
        ApiError e;
        e.http_status = 401;
        e.message = auth.empty() ? "no API key: send it as 'Authorization: Bearer KEY'"
                                 : "the API key is not one this server accepts";
        e.code = "invalid_api_key";
        basic_challenge_ = status_page;
        ReplyError(e);
        return;
      }
    }
    if (path == "/health") {
      if (only(http::verb::get)) Health();
    } else if (path == "/metrics") {
      if (only(http::verb::get)) {
        Reply(http::status::ok, RenderMetrics(router_.Snapshot()), "text/plain; version=0.0.4");
      }
    } else if (path == "/" || path == "/status") {
      if (only(http::verb::get))
        Reply(http::status::ok, StatusPageHtml(), "text/html; charset=utf-8");
    } else if (path == "/status.json") {
      if (only(http::verb::get)) {
        Reply(http::status::ok, Dump(StatusJson(router_.Snapshot())), "application/json");
      }
    } else if (path == "/favicon.ico") {
      // A browser asks for it with every page: no icon, and no 404 among the errors.
      if (only(http::verb::get)) Reply(http::status::no_content, "", "image/x-icon");
    } else if (path == "/v1/models") {
      if (only(http::verb::get)) {
        json m = {{"object", "list"},
                  {"data", json::array({{{"id", router_.served.name},
                                         {"object", "model"},
                                         {"created", router_.started},
                                         {"owned_by", "kdn"},
                                         {"max_model_len", router_.config.max_context}}})}};
        Reply(http::status::ok, Dump(m), "application/json");
      }
    } else if (path == "/v1/kdn/pins" || path.starts_with("/v1/kdn/pins/")) {
      route_ = "/v1/kdn/pins";  // one metrics label, whatever the pin
      Pins(path == "/v1/kdn/pins", path.size() > 12 ? path.substr(13) : std::string());
    } else if (path == "/v1/kdn/inject") {
      if (only(http::verb::post)) Inject(/*edit=*/false);
    } else if (path == "/v1/kdn/edit") {
      if (only(http::verb::post)) Inject(/*edit=*/true);
    } else if (path == "/v1/kdn/steering") {
      if (only(http::verb::post)) Inject(/*edit=*/false, /*steering=*/true);
    } else if (path == "/v1/completions" || path == "/v1/chat/completions") {
      if (only(http::verb::post)) {
        Generate(path == "/v1/completions" ? ApiKind::kCompletion : ApiKind::kChat);
      }
    } else {
      route_ = "other";
      ApiError e;
      e.http_status = 404;
      e.message = "no route " + path + " (see docs/serving.md)";
      ReplyError(e);
    }
  }

  // The tenant whose pins a request sees: its API key's, "" without keys.
  std::string TenantName() const { return tenant_ != nullptr ? *tenant_ : std::string(); }

  // /v1/kdn/pins: GET lists the tenant's live pins; DELETE drops them all,
  // DELETE /v1/kdn/pins/ID drops one (docs/serving.md, "Pinning a prefix").
  // `all`: the path names no pin.
  void Pins(bool all, const std::string& id) {
    const auto method = request_.method();
    const auto not_found = [this](std::string message) {
      ApiError e;
      e.http_status = 404;
      e.message = std::move(message);
      e.code = "pin_not_found";
      ReplyError(e);
    };
    if (!all && id.empty()) return not_found("no pin named in " + route_ + "/");
    if (method == http::verb::get && all) {
      json data = json::array();
      for (const PinInfo& p : router_.backend->Pins(TenantName())) {
        data.push_back({{"id", p.id},
                        {"object", "kdn.pin"},
                        {"tokens", p.tokens},
                        {"bytes", p.bytes},
                        {"ttl_seconds", p.ttl.count()},
                        {"created_at", p.created_at},
                        {"expires_at", p.expires_at},
                        {"hits", p.hits}});
      }
      return Reply(http::status::ok, Dump({{"object", "list"}, {"data", data}}),
                   "application/json");
    }
    if (method == http::verb::delete_) {
      const Status st = router_.backend->Unpin(TenantName(), id);
      if (st.ok()) {
        return Reply(http::status::ok,
                     Dump({{"id", id.empty() ? json(nullptr) : json(id)},
                           {"object", "kdn.pin.deleted"},
                           {"deleted", true}}),
                     "application/json");
      }
      return not_found(st.message());
    }
    ApiError e;
    e.http_status = 405;
    e.message = std::string("method ") + std::string(request_.method_string()) +
                " is not allowed on /v1/kdn/pins (GET /v1/kdn/pins, DELETE /v1/kdn/pins[/ID])";
    ReplyError(e);
  }

  void Health() {
    json body;
    const bool ok = HealthJson(router_.Snapshot(), &body);
    Reply(ok ? http::status::ok : http::status::service_unavailable, Dump(body),
          "application/json");
  }

  // Parses the body on the parse pool (the session waits meanwhile: nothing
  // touches request_ or the stream until the result is back on the I/O
  // thread), then starts the job there.
  void Generate(ApiKind kind) {
    asio::post(router_.parse_pool, [self = shared_from_this(), kind] {
      auto req = std::make_shared<ApiRequest>();
      auto err = ParseRequest(kind, self->request_.body(), self->router_.served, req.get());
      asio::post(self->router_.io, [self, kind, req, err = std::move(err)] {
        if (err) return self->ReplyError(*err);
        self->StartGenerate(kind, std::move(*req));
      });
    });
  }

  void StartGenerate(ApiKind kind, ApiRequest req) {
    kind_ = kind;
    stream_mode_ = req.stream;
    include_usage_ = req.include_usage;
    created_ = UnixNow();
    // The namespace before the move: arguments are evaluated in no set order.
    std::string ns = RequestNamespace(tenant_, req.cache_salt);
    Job job = ToJob(std::move(req), std::move(ns), route_);
    job.tenant = TenantName();
    if (stream_mode_) stream_.expires_never();
    BeginJob();
    job_ = router_.backend->Submit(std::move(job), JobEvents());
    // The OpenAI id is the request id that every process's log lines carry.
    request_id_ = FormatRequestId(job_);
    response_id_ = (kind == ApiKind::kChat ? "chatcmpl-" : "cmpl-") + request_id_;
    WatchClient(job_);
  }

  // The job about to start counts as in flight and live.
  void BeginJob() {
    job_start_ = std::chrono::steady_clock::now();
    router_.metrics.InFlight(1);
    in_flight_ = true;
    job_live_ = true;
  }

  // While job `job` runs, watches the connection for the client going away:
  // a non-streaming request or injection writes nothing until it ends, so
  // no failed write would tell. Readable with nothing to read is the
  // client's FIN (or an error): the job is cancelled. Bytes to read (a
  // pipelined request) end the watch; they are left for the next read.
  void WatchClient(uint64_t job) {
    stream_.socket().async_wait(
        tcp::socket::wait_read, [self = shared_from_this(), job](beast::error_code ec) {
          if (!self->job_live_ || self->job_ != job || ec == asio::error::operation_aborted) {
            return;
          }
          beast::error_code avail_ec;
          if (!ec && self->stream_.socket().available(avail_ec) > 0 && !avail_ec) return;
          self->ClientGone(ec ? ec.message() : std::string("the connection was closed"));
        });
  }

  // The client went away while its job ran: stop the job.
  void ClientGone(const std::string& why) {
    if (job_live_) {
      router_.backend->Cancel(job_);
      job_live_ = false;
      EndInFlight();
      router_.metrics.RequestFinished(route_, 499);
      LogInfo("{} cancelled: the client went away (499) after {:.1f} ms: {}", ReqId{job_}, JobMs(),
              why);
    }
    queue_.clear();
    Close();
  }

  // The callback that brings a job's events (on the backend thread) to this
  // session's I/O thread.
  JobCallback JobEvents() {
    return [self = shared_from_this()](JobEvent ev) {
      asio::post(self->router_.io,
                 [self, ev = std::move(ev)]() mutable { self->OnJobEvent(std::move(ev)); });
    };
  }

  // POST /v1/kdn/inject: stores documents' KV in the KDN. With "stream",
  // one SSE event per document done, then the summary. POST /v1/kdn/edit
  // (`edit`): stores a stored document's edited version, as an injection of
  // one document whose original must be held. POST /v1/kdn/steering
  // (`steering`): makes and stores a steering vector, as an injection of
  // one empty document.
  void Inject(bool edit, bool steering = false) {
    asio::post(router_.parse_pool, [self = shared_from_this(), edit, steering] {
      auto req = std::make_shared<InjectApiRequest>();
      const std::string& body = self->request_.body();
      auto err = steering ? ParseSteeringRequest(body, self->router_.served, req.get())
                 : edit   ? ParseEditRequest(body, self->router_.served, req.get())
                          : ParseInjectRequest(body, self->router_.served, req.get());
      asio::post(self->router_.io, [self, req, err = std::move(err)] {
        if (err) return self->ReplyError(*err);
        self->StartInject(std::move(*req));
      });
    });
  }

  void StartInject(InjectApiRequest req) {
    inject_ = true;
    edit_ = req.edit;
    stream_mode_ = req.stream;
    created_ = UnixNow();
    InjectJob job;
    job.documents = std::move(req.documents);
    job.base_tokens = std::move(req.base_tokens);
    job.base_required = req.edit;
    if (req.edit) {
      edit_tokens_ = {job.base_tokens.front(),
                      static_cast<int64_t>(job.documents.front().size()) - job.base_tokens.front()};
      if (req.steer) edit_tokens_ = {static_cast<int64_t>(job.documents.front().size()), 0};
    }
    steer_ = req.steer;
    steering_vector_ = req.steering_vector;
    if (req.steering_vector) job.documents = {{}};  // one part, no document
    job.steer = std::move(req.steer);
    job.steering_vector = std::move(req.steering_vector);
    job.ns = RequestNamespace(tenant_, req.cache_salt);
    job.prune = std::move(req.prune);
    stream_.expires_never();
    BeginJob();
    job_ = router_.backend->Inject(std::move(job), JobEvents());
    request_id_ = FormatRequestId(job_);
    WatchClient(job_);
  }

  double JobMs() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - job_start_)
        .count();
  }

  // The end of a job that failed, with the HTTP status it answers (or sent
  // in its stream, after a 200): an error when the fault is the server's.
  void LogFailed(const ApiError& e) {
    Log(e.http_status >= 500 ? LogLevel::kError : LogLevel::kWarn,
        "{} failed: {} {} after {:.1f} ms: {}", ReqId{job_}, e.http_status, e.type, JobMs(),
        e.message);
  }

  void SendStreamHeader() {
    // The header waits for the first event, so that a request refused
    // before it produced anything still gets a 4xx/5xx status.
    std::string head =
        "HTTP/1.1 200 OK\r\nServer: kdn-router\r\nContent-Type: text/event-stream\r\n"
        "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n";
    if (!request_id_.empty()) head += "X-Request-Id: " + request_id_ + "\r\n";
    head += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    Enqueue(std::move(head));
    header_sent_ = true;
  }

  void OnInjectEvent(JobEvent ev) {
    if (ev.kind == JobEvent::Kind::kProgress) {
      if (!stream_mode_) return;
      if (!header_sent_) SendStreamHeader();
      Enqueue(Chunked(SseEvent(Dump(ProgressJson(ev.progress, false)))));
      return;
    }
    job_live_ = false;
    EndInFlight();
    const InjectProgress& p = ev.progress;
    if (ev.kind == JobEvent::Kind::kError) {
      LogFailed(JobError(ev.error));
    } else {
      LogInfo(
          "{} finished: {} documents, {} stored, {} already held, {} failed, {} tokens, "
          "{:.1f} ms",
          ReqId{job_}, p.total, p.stored, p.already_held, p.failed, p.tokens, JobMs());
    }
    if (edit_ && ev.kind == JobEvent::Kind::kDone) return ReplyEdit(p);
    if (steering_vector_ && ev.kind == JobEvent::Kind::kDone) return ReplySteering(p);
    if (ev.kind == JobEvent::Kind::kDone && p.failed == p.total && p.total > 0 && !header_sent_) {
      // Nothing stored: the first failure is the answer.
      ApiError e;
      e.http_status = 502;
      e.type = "server_error";
      e.message = "no document was stored: " + p.errors.front().second;
      ReplyError(e);
      return;
    }
    if (!stream_mode_ || !header_sent_) {
      if (ev.kind == JobEvent::Kind::kError) {
        ReplyError(JobError(ev.error));
      } else {
        Reply(http::status::ok, Dump(ProgressJson(p, true)), "application/json");
      }
      return;
    }
    std::string out;
    if (ev.kind == JobEvent::Kind::kError) {
      const ApiError e = JobError(ev.error);
      router_.metrics.Error(route_, e.http_status, e.message);  // mid-stream: sent as 200
      out = SseEvent(Dump(ErrorBody(e)));
    } else {
      out = SseEvent(Dump(ProgressJson(p, true)));
    }
    out += SseEvent("[DONE]");
    Enqueue(Chunked(out));
    FinishStream();
  }

  // /v1/kdn/edit's answer: the edited version stored (or held already), a
  // 400 when the original is not in the KDN, a 502 when it failed.
  void ReplyEdit(const InjectProgress& p) {
    if (p.failed > 0) {
      ApiError e;
      if (p.missing_base > 0) {
        e.http_status = 400;
        e.param = "document";
        e.message = "the document is not in the KDN under this cache_salt: inject it first (" +
                    p.errors.front().second + ")";
      } else if (steer_ && p.first_error_code == StatusCode::kFailedPrecondition) {
        e.http_status = 400;
        e.param = "steer.vector";
        e.message = p.errors.front().second;
      } else {
        e = JobError(Status(p.first_error_code, p.errors.front().second));
        if (e.http_status >= 500) e.message = "the edit was not stored: " + e.message;
      }
      return ReplyError(e);
    }
    json j = {{"object", "kdn.edit"},
              {"edit", steer_ ? "steer" : "erratum"},
              {"document_tokens", edit_tokens_.first},
              {"already_held", p.already_held > 0},
              {"stored_tokens", p.stored_tokens}};
    if (steer_) {
      j["steer"] = {{"vector", steer_->vector}, {"strength", steer_->strength}};
    } else {
      j["erratum_tokens"] = edit_tokens_.second;
    }
    Reply(http::status::ok, Dump(j), "application/json");
  }

  // /v1/kdn/steering's answer: the vector made and stored (or held already),
  // a 409 when its name holds another vector, a 502 when it failed.
  void ReplySteering(const InjectProgress& p) {
    if (p.failed > 0) {
      ApiError e = JobError(Status(p.first_error_code, p.errors.front().second));
      if (p.first_error_code == StatusCode::kFailedPrecondition) {
        e.http_status = 409;
        e.type = "conflict_error";
        e.param = "name";
      } else if (e.http_status >= 500) {
        e.message = "the steering vector was not stored: " + e.message;
      }
      return ReplyError(e);
    }
    const blend::SteeringVectorSpec& v = *steering_vector_;
    const json j = {{"object", "kdn.steering_vector"},
                    {"name", v.name},
                    {"layers", v.layers},
                    {"pairs", v.pairs.size()},
                    {"already_held", p.already_held > 0}};
    Reply(http::status::ok, Dump(j), "application/json");
  }

  void OnJobEvent(JobEvent ev) {
    if (!job_live_) return;
    if (inject_) return OnInjectEvent(std::move(ev));
    const std::string& model = router_.served.name;
    if (ev.kind == JobEvent::Kind::kError) {
      job_live_ = false;
      EndInFlight();
      ApiError e = JobError(ev.error);
      LogFailed(e);
      if (!stream_mode_ || !header_sent_) {
        // Nothing streamed yet: the failure gets its own status code.
        ReplyError(e);
        return;
      }
      router_.metrics.Error(route_, e.http_status, e.message);  // mid-stream: sent as 200
      Enqueue(Chunked(SseEvent(Dump(ErrorBody(e)))));
      FinishStream();
      return;
    }
    text_ += ev.text;
    if (stream_mode_ && !header_sent_) SendStreamHeader();
    if (ev.kind == JobEvent::Kind::kTokens) {
      if (stream_mode_ && !ev.text.empty()) {
        Enqueue(Chunked(SseEvent(Dump(
            StreamChunk(kind_, response_id_, created_, model, ev.text, nullptr, first_chunk_)))));
        first_chunk_ = false;
      }
      return;
    }
    // kDone
    job_live_ = false;
    EndInFlight();
    LogInfo("{} finished: {}, {} prompt tokens ({} cached), {} completion tokens, 200, {:.1f} ms",
            ReqId{job_}, ev.finish_reason, ev.usage.prompt_tokens, ev.usage.cached_tokens,
            ev.usage.completion_tokens, JobMs());
    if (!stream_mode_) {
      Reply(http::status::ok,
            Dump(CompletionResponse(kind_, response_id_, created_, model, text_, ev.finish_reason,
                                    ev.usage)),
            "application/json");
      return;
    }
    std::string out = SseEvent(Dump(StreamChunk(kind_, response_id_, created_, model, ev.text,
                                                &ev.finish_reason, first_chunk_)));
    if (include_usage_) {
      out += SseEvent(Dump(StreamUsageChunk(kind_, response_id_, created_, model, ev.usage)));
    }
    out += SseEvent("[DONE]");
    Enqueue(Chunked(out));
    FinishStream();
  }

  void EndInFlight() {
    if (in_flight_) router_.metrics.InFlight(-1);
    in_flight_ = false;
  }

  void FinishStream() {
    Enqueue("0\r\n\r\n");
    stream_done_ = true;
    router_.metrics.RequestFinished(route_, 200);
  }

  void ReplyError(const ApiError& e) {
    router_.metrics.Error(route_, e.http_status, e.message);
    Reply(static_cast<http::status>(e.http_status), Dump(ErrorBody(e)), "application/json");
  }

  void Reply(http::status status, std::string body, const char* content_type) {
    router_.metrics.RequestFinished(route_, static_cast<int>(status));
    auto res = std::make_shared<http::response<http::string_body>>(status, 11);
    res->set(http::field::server, "kdn-router");
    res->set(http::field::content_type, content_type);
    if (!request_id_.empty()) res->set("X-Request-Id", request_id_);
    if (retry_after_) res->set(http::field::retry_after, "1");
    if (basic_challenge_) res->set(http::field::www_authenticate, "Basic realm=\"kdn-router\"");
    res->keep_alive(keep_alive_);
    res->body() = std::move(body);
    res->prepare_payload();
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res](beast::error_code ec, size_t) {
                        if (ec || !self->keep_alive_) return self->Close();
                        self->ResetRequestState();
                        self->Read();
                      });
  }

  void ResetRequestState() {
    text_.clear();
    first_chunk_ = true;
    stream_done_ = false;
    stream_mode_ = false;
    header_sent_ = false;
    job_live_ = false;
    inject_ = false;
    edit_ = false;
    basic_challenge_ = false;
    request_id_.clear();
  }

  void Enqueue(std::string piece) {
    queue_.push_back(std::move(piece));
    if (!writing_) DoWrite();
  }

  void DoWrite() {
    writing_ = true;
    asio::async_write(
        stream_.socket(), asio::buffer(queue_.front()),
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnWrite(ec); });
  }

  void OnWrite(beast::error_code ec) {
    writing_ = false;
    // The client went away mid-stream: stop the job.
    if (ec) return ClientGone(ec.message());
    queue_.pop_front();
    if (!queue_.empty()) return DoWrite();
    if (stream_done_) {
      if (!keep_alive_) return Close();
      ResetRequestState();
      Read();
    }
  }

  void Close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

  beast::tcp_stream stream_;
  ServerState& router_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  http::request<http::string_body> request_;
  bool keep_alive_ = true;
  bool retry_after_ = false;      // the reply asks the client to come back in 1 s
  bool basic_challenge_ = false;  // a 401 for the status page asks a browser for the key
  uint64_t body_reserved_ = 0;    // of router_.bodies, for the body being read or served
  std::string route_ = "other";

  // The generation being served.
  ApiKind kind_ = ApiKind::kCompletion;
  bool stream_mode_ = false;
  bool include_usage_ = false;
  bool first_chunk_ = true;
  bool job_live_ = false;
  bool in_flight_ = false;
  bool stream_done_ = false;
  bool header_sent_ = false;
  bool inject_ = false;                      // the job is an injection
  bool edit_ = false;                        // of one edited document (/v1/kdn/edit)
  std::pair<int64_t, int64_t> edit_tokens_;  // an edit's document's tokens, its erratum's
  std::optional<blend::SteerSpec> steer_;    // a steer edit's
  std::optional<blend::SteeringVectorSpec> steering_vector_;  // /v1/kdn/steering's
  const std::string* tenant_ = nullptr;  // the request's, when keys are configured
  uint64_t job_ = 0;
  std::string request_id_;  // job_ as X-Request-Id gives it; empty: no job
  std::chrono::steady_clock::time_point job_start_;
  int64_t created_ = 0;
  std::string response_id_;
  std::string text_;
  std::deque<std::string> queue_;
  bool writing_ = false;
};

}  // namespace

void StartSession(tcp::socket socket, ServerState& state) {
  std::make_shared<Session>(std::move(socket), state)->Start();
}

}  // namespace kdn::router
