# cmake -DLIBS_FILE=<a library's link closure, one a line>
#       -DFORBIDDEN=<libraries, comma-separated> -P check_closure.cmake
# Fails naming each forbidden library the closure holds.
cmake_minimum_required(VERSION 3.25)

string(REPLACE "," ";" forbidden "${FORBIDDEN}")
file(STRINGS ${LIBS_FILE} libs)
set(problems "")
foreach(lib IN LISTS libs)
  if(lib IN_LIST forbidden)
    list(APPEND problems "links ${lib}")
  endif()
endforeach()
if(problems)
  string(REPLACE ";" "\n  " text "${problems}")
  message(FATAL_ERROR "${LIBS_FILE}:\n  ${text}")
endif()
message(STATUS "${LIBS_FILE}: none of ${FORBIDDEN}")
