#include <pybind11/pybind11.h>
namespace py = pybind11;
PYBIND11_MODULE(_engine, m) {
    m.doc() = "sdp_jupyter native AllReduce engine";
    m.attr("__version__") = "0.1.0";
}
