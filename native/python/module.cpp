// The Python face of the engine: converts arguments, releases the GIL around anything that
// blocks, and turns sdp::Error into sdp_jupyter._engine.EngineError. Nothing else lives here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "sdp/coll_records.h"
#include "sdp/crash.h"
#include "sdp/engine.h"
#include "sdp/hmac.h"
#include "sdp/mailbox.h"
#include "sdp/reduce.h"
#include "sdp/shm_node.h"

namespace py = pybind11;
using namespace sdp;

namespace {

DType to_dtype(int t) {
  if (!valid_dtype(t)) throw Error("invalid dtype code " + std::to_string(t));
  return DType(t);
}
ReduceOp to_op(int op) {
  if (!valid_op(op)) throw Error("invalid reduce op code " + std::to_string(op));
  return ReduceOp(op);
}
Coll to_coll(int c) {
  if (!find_coll(c)) throw Error("invalid collective code " + std::to_string(c));
  return Coll(c);
}

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "sdp_jupyter native AllReduce engine (works on raw buffers; no torch headers)";
  m.attr("__version__") = "0.1.0";
  py::register_exception<Error>(m, "EngineError", PyExc_RuntimeError);

  // The codes of common.h, bound once: sdp_jupyter.comm builds its tables from these.
  py::enum_<DType>(m, "DType")
      .value("float32", DType::F32)
      .value("float64", DType::F64)
      .value("float16", DType::F16)
      .value("bfloat16", DType::BF16)
      .value("int32", DType::I32)
      .value("int64", DType::I64)
      .value("uint8", DType::U8)
      .value("int8", DType::I8);
  py::enum_<ReduceOp>(m, "ReduceOp")
      .value("sum", ReduceOp::SUM)
      .value("avg", ReduceOp::AVG)
      .value("max", ReduceOp::MAX)
      .value("min", ReduceOp::MIN)
      .value("product", ReduceOp::PRODUCT);
  // The collectives, from their records (coll_records.h): Coll by name, and each record's fields.
  py::enum_<Coll> colls(m, "Coll");
  for (const CollRecord& r : coll_records()) colls.value(r.name, r.code);
  m.def(
      "collectives",
      [] {
        py::list out;
        for (const CollRecord& r : coll_records()) {
          py::dict d;
          d["name"] = r.name;
          d["code"] = int(r.code);
          d["reduces"] = r.reduces;
          d["rooted"] = r.rooted;
          d["root_blocks"] = r.root_blocks;
          d["needs_src"] = r.needs_src;
          d["span"] = span_name(r.span);
          d["doc"] = r.doc;
          out.append(d);
        }
        return out;
      },
      "One dict per collective, from the engine's records (native/include/sdp/coll_records.h).");
  py::enum_<FlightState>(m, "FlightState")
      .value("posted", FlightState::POSTED)
      .value("started", FlightState::STARTED)
      .value("finished", FlightState::FINISHED)
      .value("failed", FlightState::FAILED)
      .value("skipped", FlightState::SKIPPED);

  // The engine's numbers that Python decides by (bound, never copied): the size up to which a
  // block moves through the node's small slots and an engine call costs more than a message saves
  // (shm_node.h), and the defaults of EngineConfig (engine.h).
  m.attr("SMALL_BYTES") = py::int_(kSmallBytes);
  const EngineConfig defaults;
  m.attr("DEFAULT_CHUNK_BYTES") = py::int_(defaults.chunk_bytes);
  m.attr("DEFAULT_TIMEOUT") = py::float_(defaults.timeout_s);
  m.def("dtype_size", [](int dtype) { return dtype_size(to_dtype(dtype)); }, py::arg("dtype"),
        "Bytes per element of a dtype code.");

  m.def("install_crash_report", &install_crash_report,
        "On a fatal signal, print the thread's name and native frames to stderr, then run the handler that was "
        "there before (call after faulthandler.enable()).");
  m.def("kernel_isa", &kernel_isa, "Which reduction kernels are in use: 'avx2+f16c' or 'portable'.");
  m.def("hmac_sha256", [](py::bytes key, py::bytes msg) {
    std::string k = key, s = msg;
    Digest d = hmac_sha256(k, reinterpret_cast<const uint8_t*>(s.data()), s.size());
    return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
  });
  m.def(
      "reduce_buffers",
      [](int dtype, int op, uintptr_t dst, std::vector<uintptr_t> srcs, size_t count) {
        std::vector<const void*> p;
        for (auto s : srcs) p.push_back(reinterpret_cast<const void*>(s));
        py::gil_scoped_release nogil;
        reduce_many(to_dtype(dtype), to_op(op), reinterpret_cast<void*>(dst), p.data(), int(p.size()), count);
      },
      "Run one reduction kernel on raw pointers (for tests and benchmarks of the kernels alone).");
  m.def(
      "copy_scaled",
      [](int dtype, uintptr_t dst, uintptr_t src, size_t count, double divisor) {
        py::gil_scoped_release nogil;
        copy_scaled(to_dtype(dtype), reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), count, divisor);
      });

  py::class_<Engine>(m, "Engine")
      .def(py::init([](int rank, std::vector<int> node_of_rank, py::bytes secret, std::string bind_addr,
                       double timeout, size_t chunk_bytes, int spin) {
             EngineConfig c;
             c.rank = rank;
             c.node_of_rank = std::move(node_of_rank);
             c.secret = secret;
             c.bind_addr = std::move(bind_addr);
             c.timeout_s = timeout;
             c.chunk_bytes = chunk_bytes;
             c.spin = spin;
             return new Engine(std::move(c));
           }),
           py::arg("rank"), py::arg("node_of_rank"), py::arg("secret"), py::arg("bind_addr") = "127.0.0.1",
           py::arg("timeout") = defaults.timeout_s, py::arg("chunk_bytes") = defaults.chunk_bytes, py::arg("spin") = -1)
      .def(
          "prepare", [](Engine& e, int port_lo, int port_hi) { return e.prepare(PortRange{port_lo, port_hi}); },
          py::arg("port_lo") = 0, py::arg("port_hi") = 0, py::call_guard<py::gil_scoped_release>())
      .def("connect", &Engine::connect, py::call_guard<py::gil_scoped_release>())
      .def(
          "submit",
          // The common call (all_reduce, broadcast, ...), with no default converted per call:
          // a few microseconds count at 4 KiB.
          [](Engine& e, int coll, uintptr_t ptr, size_t count, int dtype, int op, int root) {
            return e.submit(to_coll(coll), reinterpret_cast<void*>(ptr), count, to_dtype(dtype), to_op(op), root, nullptr, {});
          },
          py::arg("coll"), py::arg("ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("root"))
      .def(
          "submit_buffers",
          // gather/scatter (the root's one buffer per rank) and all_to_all (its input buffer)
          [](Engine& e, int coll, uintptr_t ptr, size_t count, int dtype, int op, int root, uintptr_t src,
             std::vector<uintptr_t> blocks) {
            std::vector<char*> b;
            for (auto p : blocks) b.push_back(reinterpret_cast<char*>(p));
            return e.submit(to_coll(coll), reinterpret_cast<void*>(ptr), count, to_dtype(dtype), to_op(op), root,
                            reinterpret_cast<const void*>(src), std::move(b));
          },
          py::arg("coll"), py::arg("ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("root"),
          py::arg("src"), py::arg("blocks"))
      .def("wait", &Engine::wait, py::arg("handle"), py::arg("timeout") = 0.0, py::call_guard<py::gil_scoped_release>())
      .def("test", &Engine::test)
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def("broken_message", &Engine::broken_message)
      .def("report", &Engine::report, py::arg("message"),
           "A failure seen outside the engine (a message whose peer died): the group fails with it and passes it on.")
      .def("stats",
           [](Engine& e) {
             Stats s = e.stats();
             py::dict d;
             d["collectives"] = s.collectives;
             d["bytes"] = s.bytes;
             d["busy_s"] = s.busy_s;
             d["peer_read_bytes"] = s.peer_read_bytes;
             return d;
           })
      .def(
          "flight",
          // (seq, coll, dtype, op, count, root, state, posted, started, ended) per entry, oldest
          // first; the codes are the enums above and FlightState's (sdp_jupyter/comm/recorder.py)
          [](Engine& e, size_t last) {
            py::list out;
            for (const FlightEntry& f : e.flight(last))
              out.append(py::make_tuple(f.seq, int(f.coll), int(f.dtype), int(f.op), f.count, f.root, int(f.state),
                                        f.posted, f.started, f.ended));
            return out;
          },
          py::arg("last") = 0)
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("world_size", &Engine::world_size)
      .def_property_readonly("node", &Engine::node)
      .def_property_readonly("num_nodes", &Engine::num_nodes)
      .def_property_readonly("local_rank", &Engine::local_rank)
      .def_property_readonly("local_size", &Engine::local_size)
      .def_property_readonly("is_leader", &Engine::is_leader)
      .def_property_readonly("port", &Engine::listen_port);

  py::class_<Mailbox>(m, "Mailbox", "Point-to-point messages between the ranks of a group (mailbox.h).")
      .def(py::init([](int rank, int world_size, py::bytes secret, std::string bind_addr, double timeout, bool spin) {
             return new Mailbox(rank, world_size, std::string(secret), std::move(bind_addr), timeout, spin);
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("secret"), py::arg("bind_addr") = "127.0.0.1",
           py::arg("timeout") = defaults.timeout_s, py::arg("spin") = true)
      .def(
          "listen", [](Mailbox& mb, int port_lo, int port_hi) { return mb.listen(PortRange{port_lo, port_hi}); },
          py::arg("port_lo") = 0, py::arg("port_hi") = 0, py::call_guard<py::gil_scoped_release>())
      .def("set_peers", &Mailbox::set_peers)
      .def(
          "isend",
          [](Mailbox& mb, int dst, int64_t tag, uintptr_t ptr, size_t nbytes) {
            return mb.isend(dst, tag, reinterpret_cast<const void*>(ptr), nbytes);
          },
          py::arg("dst"), py::arg("tag"), py::arg("ptr"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>())
      .def(
          "irecv",
          [](Mailbox& mb, int src, int64_t tag, uintptr_t ptr, size_t nbytes) {
            return mb.irecv(src, tag, reinterpret_cast<void*>(ptr), nbytes);
          },
          py::arg("src"), py::arg("tag"), py::arg("ptr"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>())
      .def("wait", &Mailbox::wait, py::arg("handle"), py::arg("timeout") = 0.0, py::call_guard<py::gil_scoped_release>())
      .def("test", &Mailbox::test)
      .def("shutdown", &Mailbox::shutdown, py::call_guard<py::gil_scoped_release>());
}
