// Trace-driven traffic manager for BookSim 2.0 (hdamoe-env validation, issue #27).
//
// Own code of the hdamoe-env project; it is compiled into a BookSim 2.0 build made outside the
// repository by build.sh. BookSim 2.0 itself is (c) Stanford University, BSD licence.
//
// sim_type = trace reads `trace_file`: one message per line, "ready_cycle src dst flits", and
// injects every message as one packet at its source once the cycle has come (messages of one
// source in (ready, line) order, as the injection queue of the node serialises them). When every
// message has been ejected it writes "index arrival_cycle" per message (the cycle its tail flit
// was ejected) and a last line "makespan cycles" to `trace_out`.
#ifndef _TRACETRAFFICMANAGER_HPP_
#define _TRACETRAFFICMANAGER_HPP_

#include <deque>
#include <map>
#include <string>
#include <vector>

#include "trafficmanager.hpp"

class TraceTrafficManager : public TrafficManager {

protected:

  std::vector<long> _ready;
  std::vector<int> _dst;
  std::vector<int> _flits;
  std::vector<long> _arrival;
  std::vector<std::deque<int> > _queue;   // per source: message indices in injection order
  std::map<int, int> _msg_of_pid;
  long _num_done;
  std::string _out_file;

  virtual int _IssuePacket( int source, int cl );
  virtual void _GeneratePacket( int source, int stype, int cl, int time );
  virtual void _RetireFlit( Flit *f, int dest );
  virtual bool _SingleSim( );

public:

  TraceTrafficManager( const Configuration &config, const std::vector<Network *> & net );
  virtual ~TraceTrafficManager( );

};

#endif
