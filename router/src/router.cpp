#include "kdn/router/router.h"

#include <algorithm>
#include <filesystem>

#include "kdn/common/log.h"
#include "server_state.h"

namespace kdn::router {

namespace {

constexpr std::string_view kTooManyConnections =
    R"json({"error":{"message":"the router has too many open connections (--max-connections)",)json"
    R"json("type":"service_unavailable","param":null,"code":null}})json";

}  // namespace

struct Router::Impl : ServerState {
  void Accept();
};

void Router::Impl::Accept() {
  acceptor->async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (ec) {
      if (ec == asio::error::operation_aborted) return;
      // It can fail on every try (out of file descriptors): rate-limited,
      // and tried again after a back-off rather than at once, which would
      // spin a core.
      accept_backoff = std::clamp(accept_backoff * 2, std::chrono::milliseconds(10),
                                  std::chrono::milliseconds(1000));
      static LogLimiter limiter;
      limiter.Error("accept: {} (trying again in {} ms)", ec.message(), accept_backoff.count());
      metrics.AcceptFailed();
      accept_timer->expires_after(accept_backoff);
      accept_timer->async_wait([this](beast::error_code wait_ec) {
        if (wait_ec != asio::error::operation_aborted) Accept();
      });
      return;
    }
    accept_backoff = std::chrono::milliseconds(0);
    socket.set_option(tcp::no_delay(true), ec);
    if (sessions >= options.max_connections) {
      // Over the cap: a short answer, then the connection goes, without
      // reading the request (whose body could be large).
      static LogLimiter limiter;
      limiter.Warn("refusing a connection: {} are open (--max-connections)", sessions);
      metrics.RequestFinished("other", 503);
      auto sock = std::make_shared<tcp::socket>(std::move(socket));
      auto reply = std::make_shared<std::string>(
          "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
          "Connection: close\r\nRetry-After: 1\r\nContent-Length: " +
          std::to_string(kTooManyConnections.size()) + "\r\n\r\n" +
          std::string(kTooManyConnections));
      asio::async_write(*sock, asio::buffer(*reply), [sock, reply](beast::error_code, size_t) {
        beast::error_code ignored;
        sock->shutdown(tcp::socket::shutdown_both, ignored);
        sock->close(ignored);
      });
    } else {
      StartSession(std::move(socket), *this);
    }
    Accept();
  });
}

Router::Router(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Router>> Router::Start(const RouterOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->bodies = BodyBudget(options.max_body_buffer_bytes);
  KDN_ASSIGN_OR_RETURN(impl->config, model::LoadModelConfig(options.model_dir));
  KDN_ASSIGN_OR_RETURN(impl->tokenizer, text::Tokenizer::Load(options.model_dir));
  // Parsed once here: a template that does not parse fails the start.
  KDN_ASSIGN_OR_RETURN(impl->chat_template,
                       text::ChatTemplate::Load(options.model_dir, impl->config.architecture));
  std::string name = options.served_model_name;
  if (name.empty()) {
    const auto path = std::filesystem::path(options.model_dir).lexically_normal();
    name = (path.extension() == ".gguf" ? path.stem() : path.filename()).string();
    if (name.empty()) {
      name = std::filesystem::path(options.model_dir).lexically_normal().parent_path().filename();
    }
  }
  if (options.check_layer >= impl->config.num_layers) {
    return InvalidArgument("--check-layer " + std::to_string(options.check_layer) +
                           ": the model has " + std::to_string(impl->config.num_layers) +
                           " layers");
  }
  // No --check-layers: progressive filtering at --check-layer and the two
  // layers after it (docs/blend.md, "Choosing the tokens").
  const std::vector<int> check_layers =
      blend::ResolveCheckLayers(options.check_layer, options.check_layers,
                                !options.check_ratios.empty(), impl->config.num_layers);
  if (auto st = blend::CheckSchedule(options.recompute_ratio, options.check_layer, check_layers,
                                     options.check_ratios, impl->config.num_layers);
      !st.ok()) {
    return InvalidArgument("--check-layers/--check-ratios: " + st.status().message());
  }
  std::vector<blend::EmphasisHead> emphasis_heads =
      blend::MiddleThirdHeads(impl->config.num_layers, impl->config.num_heads);
  if (!options.emphasis_heads.empty()) {
    KDN_ASSIGN_OR_RETURN(emphasis_heads, blend::LoadEmphasisProfile(options.emphasis_heads));
    if (Status st = blend::CheckEmphasisHeads(emphasis_heads, impl->config.num_layers,
                                              impl->config.num_heads);
        !st.ok()) {
      return InvalidArgument("--emphasis-heads " + options.emphasis_heads + ": " + st.message());
    }
  }
  if (Status st = blend::CheckEmphasisStrength(options.emphasis_strength); !st.ok()) {
    return InvalidArgument("--emphasis-strength: " + st.message());
  }
  impl->served = {name,
                  &impl->config,
                  impl->tokenizer.get(),
                  options.separator,
                  options.recompute_ratio,
                  options.check_layer,
                  check_layers,
                  options.check_ratios,
                  options.selection,
                  std::move(emphasis_heads),
                  options.emphasis_strength,
                  &impl->chat_template};
  BackendOptions backend = options.backend;
  // A pinned token's KV at its largest (f32 keys and values of every layer).
  backend.kv_bytes_per_token = uint64_t{2} * sizeof(float) * impl->config.num_layers *
                               static_cast<uint64_t>(impl->config.kv_dim());
  KDN_ASSIGN_OR_RETURN(impl->backend, Backend::Start(backend, *impl->tokenizer, &impl->metrics));
  try {
    const auto address = asio::ip::make_address(options.host);
    impl->acceptor.emplace(impl->io);
    impl->accept_timer.emplace(impl->io);
    tcp::endpoint ep(address, options.port);
    impl->acceptor->open(ep.protocol());
    impl->acceptor->set_option(asio::socket_base::reuse_address(true));
    impl->acceptor->bind(ep);
    impl->acceptor->listen();
    const auto bound = impl->acceptor->local_endpoint();
    impl->url = "http://" + options.host + ":" + std::to_string(bound.port());
  } catch (const boost::system::system_error& e) {
    return Unavailable("cannot listen on " + options.host + ":" + std::to_string(options.port) +
                       ": " + e.code().message());
  }
  impl->Accept();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->io.run(); });
  return std::unique_ptr<Router>(new Router(std::move(impl)));
}

Router::~Router() {
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->backend.reset();
}

const std::string& Router::url() const { return impl_->url; }

}  // namespace kdn::router
