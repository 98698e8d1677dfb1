// Trace-driven traffic manager for BookSim 2.0 (hdamoe-env validation, issue #27).
// Own code of the hdamoe-env project; see tracetrafficmanager.hpp.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>

#include "tracetrafficmanager.hpp"

TraceTrafficManager::TraceTrafficManager( const Configuration &config,
                                          const std::vector<Network *> & net )
  : TrafficManager(config, net), _num_done(0)
{
  std::string in_file = config.GetStr("trace_file");
  _out_file = config.GetStr("trace_out");
  std::ifstream in(in_file.c_str());
  if(!in) {
    Error("cannot open trace_file " + in_file);
  }
  long ready;
  int src, dst, flits;
  std::vector<int> src_of;
  while(in >> ready >> src >> dst >> flits) {
    if(src < 0 || src >= _nodes || dst < 0 || dst >= _nodes || flits < 1 || ready < 0) {
      std::ostringstream err;
      err << "bad trace line " << _ready.size() << ": " << ready << " " << src << " " << dst
          << " " << flits;
      Error(err.str());
    }
    _ready.push_back(ready);
    _dst.push_back(dst);
    _flits.push_back(flits);
    src_of.push_back(src);
  }
  _arrival.assign(_ready.size(), -1);
  _queue.resize(_nodes);
  std::vector<int> order(_ready.size());
  for(size_t i = 0; i < order.size(); ++i) order[i] = (int)i;
  std::stable_sort(order.begin(), order.end(),
                   [this](int a, int b) { return _ready[a] < _ready[b]; });
  for(size_t i = 0; i < order.size(); ++i) _queue[src_of[order[i]]].push_back(order[i]);
}

TraceTrafficManager::~TraceTrafficManager( )
{
}

int TraceTrafficManager::_IssuePacket( int source, int cl )
{
  if(_queue[source].empty() || _ready[_queue[source].front()] > _time) return 0;
  return 1;
}

void TraceTrafficManager::_GeneratePacket( int source, int stype, int cl, int time )
{
  int m = _queue[source].front();
  _queue[source].pop_front();
  int pid = _cur_pid++;
  _msg_of_pid[pid] = m;
  int size = _flits[m];
  for(int i = 0; i < size; ++i) {
    Flit * f = Flit::New();
    f->id = _cur_id++;
    f->pid = pid;
    f->watch = false;
    f->subnetwork = 0;
    f->src = source;
    f->ctime = _time;
    f->record = false;
    f->cl = cl;
    f->type = Flit::ANY_TYPE;
    f->head = (i == 0);
    f->dest = (i == 0) ? _dst[m] : -1;
    f->pri = 0;
    f->tail = (i == size - 1);
    f->vc = -1;
    _total_in_flight_flits[f->cl].insert(std::make_pair(f->id, f));
    _partial_packets[source][cl].push_back(f);
  }
}

void TraceTrafficManager::_RetireFlit( Flit *f, int dest )
{
  if(f->tail) {
    std::map<int, int>::iterator it = _msg_of_pid.find(f->pid);
    _arrival[it->second] = _time;
    _msg_of_pid.erase(it);
    ++_num_done;
  }
  TrafficManager::_RetireFlit(f, dest);
}

bool TraceTrafficManager::_SingleSim( )
{
  _sim_state = running;
  long total = (long)_ready.size();
  while(_num_done < total) {
    _Step();
  }
  long makespan = 0;
  for(size_t i = 0; i < _arrival.size(); ++i) makespan = std::max(makespan, _arrival[i]);
  std::ofstream out(_out_file.c_str());
  for(size_t i = 0; i < _arrival.size(); ++i) out << i << " " << _arrival[i] << "\n";
  out << "makespan " << makespan << "\n";
  std::cout << "Trace makespan " << makespan << " cycles for " << total << " messages" << std::endl;
  _sim_state = draining;
  _drain_time = _time;
  return true;
}
