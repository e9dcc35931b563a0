# cmake -DPROGRAM=<binary> -DLIBS_FILE=<its link closure, one a line>
#       -DNM=<nm> -DOBJDUMP=<objdump> -P check_no_engine.cmake
# Fails if PROGRAM links the engine: a library of the engine's side in its
# declared link closure, engine code or BLAS/OpenMP/CUDA calls among its
# symbols, or BLAS/OpenMP/CUDA among the shared libraries it needs.
cmake_minimum_required(VERSION 3.25)

set(problems "")

# Declared: the engine, what links it (kvbridge, blend, the workers' setup and
# the workers), and what only it needs.
set(forbidden kdn_engine kdn_engine_open kdn_engine_cuda kdn_flash_sm90 kdn_kvbridge kdn_blend
              kdn_worker kdn_prefill_worker kdn_decode_worker kdn_openblas OpenMP::OpenMP_CXX
              CUDA::cudart CUDA::cublas)
file(STRINGS ${LIBS_FILE} libs)
foreach(lib IN LISTS libs)
  if(lib IN_LIST forbidden OR lib MATCHES "openblas|gomp|libomp|cublas")
    list(APPEND problems "links ${lib} (declared in CMake, closure in ${LIBS_FILE})")
  endif()
endforeach()

# Linked: engine code, and calls into BLAS, OpenMP or CUDA, defined or not.
# The listings go through files: file(STRINGS) matches line by line, which
# stays fast on the megabytes a program's symbols take.
get_filename_component(name ${PROGRAM} NAME)
set(listing ${CMAKE_CURRENT_BINARY_DIR}/${name}.symbols)
execute_process(COMMAND ${NM} -C ${PROGRAM} OUTPUT_FILE ${listing} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} -C ${PROGRAM} failed (${rc})")
endif()
file(STRINGS ${listing} hits REGEX "kdn::engine::|cblas_|GOMP_|omp_get_|omp_set_|cudaMalloc|cublas")
list(LENGTH hits n)
if(n GREATER 0)
  list(GET hits 0 first)
  list(APPEND problems "has ${n} engine, BLAS, OpenMP or CUDA symbols (${listing}), e.g. '${first}'")
endif()

# Needed at run time.
set(headers ${CMAKE_CURRENT_BINARY_DIR}/${name}.headers)
execute_process(COMMAND ${OBJDUMP} -p ${PROGRAM} OUTPUT_FILE ${headers} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${OBJDUMP} -p ${PROGRAM} failed (${rc})")
endif()
file(STRINGS ${headers} needed REGEX "NEEDED.*(openblas|gomp|libomp|cudart|cublas)")
foreach(line IN LISTS needed)
  string(REGEX REPLACE " *NEEDED +" "" line "${line}")
  list(APPEND problems "needs ${line} at run time")
endforeach()

if(problems)
  list(JOIN problems "\n  " text)
  message(FATAL_ERROR "${PROGRAM} must not link the engine (docs/design.md), but it\n  ${text}")
endif()
list(LENGTH libs n_libs)
message(STATUS "${PROGRAM}: ${n_libs} libraries in its link closure, none of the engine's side")
